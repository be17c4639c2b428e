"""``headrace bench`` end to end against the real daemon, at tiny sizes: every mode, the result files, the answers."""

from __future__ import annotations

import gc
import json
import sys

import pytest

from conftest import API_KEY
from headrace.bench.workloads import MIXED
from headrace.cli import main

pytestmark = pytest.mark.slow

TINY = ["--reps", "1", "--no-warmup", "--max-tokens", "4", "--documents", "2", "--doc-tokens", "150"]


@pytest.fixture
def sdk_clients_collected_open(monkeypatch):
    """The openai SDK's async HTTP clients the garbage collector finds unclosed. Such a client's ``__del__``
    schedules its ``aclose()`` in whatever event loop runs at that moment, a later test's, on connections of a
    loop already closed ("Event loop is closed" in a test that never made the client)."""
    from openai._base_client import AsyncHttpxClientWrapper

    collected: list[int] = []
    original = AsyncHttpxClientWrapper.__del__

    def record(client) -> None:
        if not client.is_closed:
            collected.append(id(client))
        original(client)

    monkeypatch.setattr(AsyncHttpxClientWrapper, "__del__", record)
    return collected


@pytest.fixture(scope="module")
def bench_run(server, tmp_path_factory):
    """naive_rag in every mode (LlamaIndex, sequential, each pass in turn, headrace) plus one load point."""
    out = tmp_path_factory.mktemp("bench")
    # Seed 1: the load point's one arrival comes at 0.29 s (seed 0's at 3.7 s, waited for idle in each series).
    code = main(["bench", "naive_rag", "--ladder", *TINY, "--rates", "0.5", "--duration", "4", "--drain", "60",
                 "--seed", "1", "--url", server.base_url, "--api-key", API_KEY, "--out", str(out)])
    assert code == 0
    return out, json.loads((out / "results.json").read_text())


def test_smoke_every_mode_writes_its_results(bench_run):
    out, results = bench_run
    section = results["workloads"]["naive_rag"]
    modes = ["llamaindex", "sequential", "+prune_dependencies", "+stage_decomposition", "+prefill_split",
             "+decode_pipelining", "headrace"]
    assert section["modes"] == modes
    single = section["single"]
    assert list(single["modes"]) == modes
    for mode, row in single["modes"].items():
        assert row["reps"] == 1 and row["mean_s"] > 0
        if mode != "llamaindex":
            assert row["speedup_vs_llamaindex"] > 0
            assert 0 <= row["overhead_share"] < 1  # server-side modes have timelines
    assert single["bound_s"] > 0 and single["latency_over_bound"] > 0
    assert single["critical_path"][0]["path"][-1]["node"].startswith(("combine", "answer"))
    load = section["load"]
    assert set(load["series"]) == {"llamaindex", "headrace"} and load["slo_s"] > 0
    for points in load["series"].values():
        (point,) = points
        assert point["rate"] == 0.5 and point["offered"] >= 1 and point["completed"] == point["offered"]
        assert point["p50_s"] > 0 and point["goodput"] >= 0
    assert load["batch_sizes"]["headrace"]  # the daemon's batch-size metrics moved under load
    text = (out / "results.txt").read_text()
    assert "naive_rag: single query" in text and "critical-path bound" in text and "Poisson load" in text
    assert single["warmup"] is False and "without warm-up" in text
    for png in ("naive_rag-speedup.png", "naive_rag-timeline.png", "naive_rag-latency-vs-load.png",
                "naive_rag-batch-sizes-headrace.png", "naive_rag-batch-sizes-llamaindex.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG", png


def test_baseline_and_headrace_answer_the_same_questions(bench_run):
    _, results = bench_run
    runs = results["workloads"]["naive_rag"]["single"]["runs"]
    by_mode = {m: [r for r in runs if r["mode"] == m] for m in ("llamaindex", "headrace")}
    questions = {m: [r["question"] for r in rs] for m, rs in by_mode.items()}
    assert questions["llamaindex"] == questions["headrace"] and all(questions["headrace"])
    corpus_questions = {q["text"] for q in results["corpus"]["questions"]}
    assert set(questions["headrace"]) <= corpus_questions
    for rs in by_mode.values():
        assert all(r["answer"].strip() for r in rs)


def test_a_missing_peer_library_fails_clearly(server, monkeypatch, capsys, tmp_path):
    from headrace.bench.baselines import llamaindex

    monkeypatch.setitem(sys.modules, "llama_index.core", None)  # import now raises ImportError
    llamaindex._lib.cache_clear()  # an earlier test may have imported it already
    try:
        code = main(["bench", "naive_rag", *TINY, "--url", server.base_url, "--api-key", API_KEY,
                     "--out", str(tmp_path)])
    finally:
        llamaindex._lib.cache_clear()
    assert code == 2
    err = capsys.readouterr().err
    assert "llama-index-core" in err and "headrace[bench]" in err
    assert not (tmp_path / "results.json").exists()


def test_bad_workload_and_mode_are_named(server, capsys, tmp_path):
    assert main(["bench", "nope", "--url", server.base_url, "--out", str(tmp_path)]) == 2
    assert "unknown workload(s) ['nope']" in capsys.readouterr().err
    code = main(["bench", "map_reduce_summary", "--modes", "llamaindex", *TINY, "--url", server.base_url,
                 "--api-key", API_KEY, "--out", str(tmp_path)])
    assert code == 2
    assert "map_reduce_summary has no mode(s) ['llamaindex']" in capsys.readouterr().err
    code = main(["bench", "naive_rag", "--modes", "headrace-deadline@x", *TINY, "--url", server.base_url,
                 "--api-key", API_KEY, "--out", str(tmp_path)])
    assert code == 2
    assert "mode 'headrace-deadline@x': '@N' takes a headrace mode" in capsys.readouterr().err


def test_llm_policy_modes_load_from_capacity_and_the_chat_phase(server, tmp_path):
    """Load points as fractions of the measured capacity, a fixed arrival count, each mode under its LLM
    policy (set on the daemon, then restored), and chat TTFT with prefix caching off and on."""
    import httpx

    code = main(["bench", "naive_rag", *TINY, "--modes", "sequential", "headrace-topology",
                 "--load-fractions", "2", "--arrivals", "3", "--drain", "120",
                 "--load-modes", "headrace-fifo", "headrace-topology@1", "--chat", "3", "--system-tokens", "300",
                 "--url", server.base_url, "--api-key", API_KEY, "--out", str(tmp_path)])
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    load = results["workloads"]["naive_rag"]["load"]
    capacity = 1 / results["workloads"]["naive_rag"]["single"]["modes"]["sequential"]["mean_s"]
    assert load["capacity"] == pytest.approx(capacity)
    assert set(load["series"]) == {"headrace-fifo", "headrace-topology@1"}  # @1: one run at a time
    for points in load["series"].values():
        (point,) = points
        assert point["offered"] == 3 and point["rate"] == pytest.approx(2 * capacity, rel=1e-3)
        assert point["completed"] == 3 and point["p99_s"] >= point["p50_s"] > 0
        # Each request's own figures, in arrival order: the percentiles above come from these.
        assert len(point["arrivals_s"]) == 3 and point["arrivals_s"] == sorted(point["arrivals_s"])
        assert max(point["latencies_s"]) == pytest.approx(point["p99_s"], rel=0.05, abs=0.01)
    chat = results["chat"]
    assert chat["requests"] == 3 and 250 <= chat["system_tokens"] <= 300
    for row in chat["modes"].values():
        assert len(row["ttft_s"]) == 3 and row["mean_s"] > 0
    assert chat["ttft_speedup"] > 0
    text = (tmp_path / "results.txt").read_text()
    assert "headrace-topology@1 / headrace-fifo" in text and "prefix caching speeds" in text
    settings = httpx.patch(f"{server.base_url}/v1/engines/smollm2", json={},
                           headers={"Authorization": f"Bearer {API_KEY}"}).json()
    # the daemon's own, restored
    assert (settings["llm_policy"], settings["prefix_caching"], settings["max_runs"]) == ("fifo", True, 0)


def test_the_summaries_run_as_semantic_calls_against_client_chaining(server, tmp_path, sdk_clients_collected_open):
    code = main(["bench", "chain_summary", "map_reduce_summary", "--modes", "chaining", "semantic", *TINY,
                 "--url", server.base_url, "--api-key", API_KEY, "--out", str(tmp_path)])
    assert code == 0
    gc.collect()
    assert sdk_clients_collected_open == []  # the bench closed the chaining baseline's client in its own loop
    results = json.loads((tmp_path / "results.json").read_text())
    for name in ("chain_summary", "map_reduce_summary"):
        modes = results["workloads"][name]["single"]["modes"]
        assert set(modes) == {"chaining", "semantic"}
        assert modes["semantic"]["speedup_vs_chaining"] > 0
        runs = results["workloads"][name]["single"]["runs"]
        assert all(r["answer"].strip() for r in runs if r["mode"] == "semantic")


def test_the_mixed_load_serves_both_workflows_and_chats_on_one_llm_in_each_mode(server, tmp_path):
    """Ayo §7.2's co-located load: advanced_rag, map_reduce_summary and plain chats drawn from one Poisson
    stream, first through the baselines (LlamaIndex, client chaining, chats), then each named headrace mode."""
    code = main(["bench", *MIXED, "--modes", "sequential", *TINY, "--mixed-rate", "2", "--arrivals", "3",
                 "--mixed-chat", "--system-tokens", "200", "--mixed-rate-modes", "headrace-deadline", "--drain", "120",
                 "--url", server.base_url, "--api-key", API_KEY, "--out", str(tmp_path)])
    assert code == 0
    mixed = json.loads((tmp_path / "results.json").read_text())["mixed"]
    assert mixed["workloads"] == [*MIXED, "chat"] and set(mixed["slo_s"]) == {*MIXED, "chat"}
    assert list(mixed["modes"]) == ["baselines", "headrace-deadline"]
    for per in mixed["modes"].values():
        # The arrivals are dealt round the three kinds in turn: one each; every one finished.
        assert [(per[w]["offered"], per[w]["completed"]) for w in mixed["workloads"]] == [(1, 1)] * 3
        assert per["all"]["goodput"] == pytest.approx(sum(per[w]["goodput"] for w in mixed["workloads"]))
    assert "== mixed load: advanced_rag + map_reduce_summary + chat" in (tmp_path / "results.txt").read_text()


def test_mixed_modes_must_be_headrace_modes(server, capsys, tmp_path):
    code = main(["bench", *MIXED, "--modes", "sequential", *TINY, "--mixed-rate", "1", "--mixed-rate-modes", "chaining",
                 "--url", server.base_url, "--api-key", API_KEY, "--out", str(tmp_path)])
    assert code == 2
    assert "--mixed-rate-modes takes headrace modes (the baselines always run): ['chaining']" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()  # refused before any phase ran


def test_debate_and_agent_against_their_client_side_loops(server, tmp_path):
    code = main(["bench", "debate", "agent", "--modes", "client", "headrace", *TINY,
                 "--url", server.base_url, "--api-key", API_KEY, "--out", str(tmp_path)])
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    for name in ("debate", "agent"):
        modes = results["workloads"][name]["single"]["modes"]
        assert set(modes) == {"client", "headrace"} and modes["headrace"]["speedup_vs_client"] > 0
        runs = results["workloads"][name]["single"]["runs"]
        assert {r["mode"] for r in runs} == {"client", "headrace"} and all(r["answer"].strip() for r in runs)


def test_rag_on_a_collection_indexed_once_against_a_llamaindex_index_kept_across_queries(server, tmp_path):
    import httpx

    warm = [a for a in TINY if a != "--no-warmup"]  # the default warm-up runs here, so that path stays tested
    code = main(["bench", "naive_rag_collection", "--modes", "llamaindex", "headrace", *warm,
                 "--url", server.base_url, "--api-key", API_KEY, "--out", str(tmp_path)])
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    section = results["workloads"]["naive_rag_collection"]
    collection = section["collection"]
    assert collection["documents"] == 2 and collection["chunks"] >= 2
    assert set(collection["index_s"]) == {"headrace", "llamaindex"}
    runs = section["single"]["runs"]
    assert {r["mode"] for r in runs} == {"llamaindex", "headrace"} and all(r["answer"].strip() for r in runs)
    # headrace's runs searched the collection: no run indexed anything of its own.
    run_id = next(r["run"] for r in runs if r["mode"] == "headrace")
    graph = httpx.get(f"{server.base_url}/v1/runs/{run_id}/graph",
                      headers={"Authorization": f"Bearer {API_KEY}"}).json()["graph"]
    ops = {n["op"] for n in graph["nodes"]}
    assert "search" in ops and not {"chunk", "ingest"} & ops
    text = (tmp_path / "results.txt").read_text()
    assert "indexed once as collection 'bench_corpus'" in text and section["single"]["warmup"] is True
    assert "reps after warm-up" in text


@pytest.mark.anyio
async def test_each_measured_query_starts_with_an_empty_prefix_cache(server):
    """Every mode of a repetition asks about the same document: the harness empties the LLM's prefix cache
    before each measured query, so no mode reuses the KV an earlier mode left."""
    from prometheus_client.parser import text_string_to_metric_families

    from headrace.bench.client import Daemon
    from headrace.bench.harness import Systems

    def usage(text: str, model: str) -> float:
        return next(s.value for family in text_string_to_metric_families(text) for s in family.samples
                    if s.name == "headrace_prefix_cache_usage_perc" and s.labels["model"] == model)

    daemon = Daemon(server.base_url, API_KEY)
    try:
        systems = Systems(daemon)
        await systems.start()
        llm = systems.models["llm"]
        system = "You answer questions about water mills. " * 40  # a few hundred tokens: whole cache blocks
        await daemon.chat_stream(llm, [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}], 2)
        assert usage(await daemon.metrics(), llm) > 0
        await systems.cold_cache()
        assert usage(await daemon.metrics(), llm) == 0
        assert (await daemon.engine_settings(llm))["prefix_caching"] is True  # switched back on
    finally:
        await daemon.aclose()
