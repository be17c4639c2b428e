"""The soak (``headrace bench soak``): its drawn mix, how it tells a lost run from a dropped stream, its criteria on
synthetic samples (a growing RSS fails), its flags, and a short smoke against a daemon it starts itself."""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest

from conftest import ROOT
from headrace.bench.client import Daemon
from headrace.bench.corpus import build_corpus
from headrace.bench.soak import (DROPPED, HTTP_4XX, HTTP_5XX, KINDS, LOST, OK, SHARES, SoakArrival, SoakRecord,
                                 SoakRunner, draw_soak, progress)
from headrace.bench.soak_report import FD_SLACK, criteria, growth_net_of_host_tier
from headrace.cli import main

CORPUS = build_corpus(0, n_documents=2, min_tokens=300, count_tokens=lambda text: len(text.split()))


def test_the_mix_is_drawn_from_the_seed_in_exact_shares_and_a_short_run_sends_every_kind():
    plan = draw_soak(100, CORPUS, seed=3)
    assert plan == draw_soak(100, CORPUS, seed=3) and plan != draw_soak(100, CORPUS, seed=4)
    assert Counter(a.kind for a in plan) == {k: round(100 * s) for k, s in SHARES.items()}
    assert [a.kind for a in plan[:14]] != sorted(a.kind for a in plan[:14])  # shuffled, not in blocks
    # Ten arrivals: ingest's 5% would round to none, so one is taken from the largest kind.
    assert set(Counter(a.kind for a in draw_soak(10, CORPUS, seed=0))) == set(KINDS)
    assert len(draw_soak(3, CORPUS, seed=0)) == 3


def _samples(rss: list[float], fds: list[int], step: float = 10.0) -> list[dict]:
    phases = ["start"] + ["load"] * (len(rss) - 2) + ["idle"]
    return [{"t_s": i * step, "phase": p, "rss_mib": r, "fds": f, "threads": 9}
            for i, (p, r, f) in enumerate(zip(phases, rss, fds))]


TOTALS = {"lost": 0, "5xx": 0}
IDLE = {"running": 0, "waiting": 0}


def test_the_criteria_pass_a_flat_run_and_fail_each_kind_of_trouble():
    # Growth before the warm-up's end (20 s here) is not counted: from 20 s, 400 -> 410 MiB is 2.5%.
    flat = criteria(_samples([200, 380, 400, 405, 410], [30, 60, 70, 64, 31]), TOTALS, 20.0, IDLE)
    assert flat["passed"] and flat["rss_growth"]["from_t_s"] == 20.0
    assert flat["rss_growth"]["growth"] == pytest.approx(0.025) and flat["rss_growth"]["max_mib"] == 410
    assert flat["fds_flat"] == {"first": 30, "last": 31, "max": 70, "slack": FD_SLACK, "passed": True}
    # A leak: RSS grows 10% after the warm-up. Only that criterion fails, and with it the verdict.
    leak = criteria(_samples([200, 380, 400, 420, 440], [30] * 5), TOTALS, 20.0, IDLE)
    assert not leak["passed"] and not leak["rss_growth"]["passed"]
    assert leak["rss_growth"]["growth"] == pytest.approx(0.1)
    assert all(leak[k]["passed"] for k in ("lost_runs", "http_5xx", "fds_flat", "drained"))
    # Descriptors that stay open after the traffic's connections closed.
    fds = criteria(_samples([400] * 5, [30, 60, 70, 64, 30 + FD_SLACK + 1]), TOTALS, 20.0, IDLE)
    assert not fds["passed"] and not fds["fds_flat"]["passed"]
    assert not criteria(_samples([400] * 3, [30] * 3), {"lost": 1, "5xx": 0}, 0.0, IDLE)["lost_runs"]["passed"]
    assert not criteria(_samples([400] * 3, [30] * 3), {"lost": 0, "5xx": 2}, 0.0, IDLE)["passed"]
    assert not criteria(_samples([400] * 3, [30] * 3), TOTALS, 0.0, {"running": 1, "waiting": 0})["passed"]
    # A window shorter than the warm-up compares from the last sample: no growth, not a crash.
    assert criteria(_samples([400, 500], [30, 30]), TOTALS, 600.0, IDLE)["rss_growth"]["growth"] == 0
    # The daemon went away mid-soak.
    gone = criteria(_samples([400, None, None], [30, None, None]), TOTALS, 0.0, IDLE)
    assert not gone["passed"] and gone["rss_growth"]["note"] == "the daemon exited"


def test_the_growth_net_of_the_host_tier_separates_a_cache_filling_to_its_budget_from_the_rest():
    samples = _samples([200, 380, 400, 500, 600], [30] * 5)
    for s, tier in zip(samples, [0, 100, 120, 220, 300]):
        s.update(host_tier_mib=tier, host_tier_budget_mib=300)
    # RSS grows 50% after the warm-up, all of it the tier: 280 MiB of the rest at 20 s, 300 at the end.
    assert criteria(samples, TOTALS, 20.0, IDLE)["rss_growth"]["growth"] == pytest.approx(0.5)
    net = growth_net_of_host_tier(samples, 20.0)
    assert (net["from_mib"], net["to_mib"], net["tier_from_mib"], net["tier_to_mib"]) == (280, 300, 120, 300)
    assert net["growth"] == pytest.approx(20 / 280) and net["tier_budget_mib"] == 300
    # A leak beside the tier still shows.
    samples[-1]["rss_mib"] = 700
    assert growth_net_of_host_tier(samples, 20.0)["growth"] == pytest.approx(120 / 280)
    # A daemon without tier figures (or gone) gives none, not a made-up figure.
    assert growth_net_of_host_tier(_samples([400, 410, 420], [30] * 3), 0.0) is None


def _sse(*events: dict, done: bool = True) -> bytes:
    lines = [f"data: {json.dumps(e)}\n\n" for e in events] + (["data: [DONE]\n\n"] if done else [])
    return "".join(lines).encode()


def _delta(text: str) -> dict:
    return {"choices": [{"delta": {"content": text}}]}


@pytest.mark.anyio
async def test_the_runner_tells_a_dropped_stream_from_lost_runs_and_error_answers():
    behave = {"as": ""}  # how the mock daemon answers the next request

    def handler(request: httpx.Request) -> httpx.Response:
        path, body, how = request.url.path, json.loads(request.content or b"{}"), behave["as"]
        if how == "500":
            return httpx.Response(500, json={"error": {"message": "internal error"}})
        if how == "400":
            return httpx.Response(400, json={"error": {"message": "bad"}})
        if how == "reset":
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")
        if path == "/v1/chat/completions" and body.get("stream"):
            if how == "broken":
                return httpx.Response(200, content=_sse(_delta("a"), {"error": {"message": "engine failed"}}))
            if how == "short":  # the model stopped before half: a completed stream, not a drop
                return httpx.Response(200, content=_sse(_delta("a")))
            if how == "cut":  # the connection ended mid-stream, no [DONE]
                return httpx.Response(200, content=_sse(_delta("a"), done=False))
            served = [_delta(str(i)) for i in range(body["max_tokens"])]
            return httpx.Response(200, content=_sse(*served))
        if path == "/v1/chat/completions":
            return httpx.Response(200, json={"choices": [{"message": {"content": "x"}, "finish_reason": "length"}]})
        if path == "/v1/responses":  # a continued turn names the first; a stuck one has no output
            assert body.get("previous_response_id") in (None, "resp-1"), body
            status = how or "completed"
            return httpx.Response(200, json={"id": "resp-1", "status": status,
                                             "output": [] if status == "in_progress" else [{"type": "message"}]})
        if path.startswith("/v1/workflows/"):
            return httpx.Response(200, json={"id": "run-1", "status": how or "succeeded", "error": None})
        if path == "/v1/embeddings":
            n = len(body["input"]) - (how == "short")
            return httpx.Response(200, json={"data": [{"embedding": [0.0]}] * n})
        if path.startswith("/v1/collections/"):
            return httpx.Response(200, json={"ids": [d["id"] for d in body["documents"]], "chunks": 1})
        return httpx.Response(404)

    daemon = Daemon("http://soak.test")
    await daemon.http.aclose()
    daemon.http = httpx.AsyncClient(base_url="http://soak.test", transport=httpx.MockTransport(handler))
    runner = SoakRunner(daemon, "llm", "embed", CORPUS, max_tokens=8)

    async def outcome(kind: str, how: str = "") -> SoakRecord:
        behave["as"] = how
        record = SoakRecord(0, kind)
        await runner.attempt(SoakArrival(0, kind, 0, 0, 0), record)
        return record

    try:
        for kind in KINDS:
            record = await outcome(kind)
            assert (record.outcome, record.status, record.error) == (DROPPED if kind == "chat_dropped" else OK, 200,
                                                                     None), kind
            assert record.latency_s >= 0
        assert (await outcome("chat_dropped", "short")).outcome == OK
        broken = await outcome("chat_dropped", "broken")
        assert broken.outcome == LOST and "engine failed" in broken.error and broken.latency_s is None
        assert (await outcome("chat_dropped", "cut")).outcome == LOST
        for kind in KINDS:  # a 5xx and a 4xx are counted as such, whatever the kind
            boom = await outcome(kind, "500")
            assert (boom.outcome, boom.status) == (HTTP_5XX, 500) and "HTTP 500" in boom.error, kind
            assert (await outcome(kind, "400")).outcome == HTTP_4XX, kind
            reset = await outcome(kind, "reset")
            assert (reset.outcome, reset.status) == (LOST, None) and "RemoteProtocolError" in reset.error, kind
        # A run the daemon answered but did not finish is lost: a 200 is not enough; nor is a short embedding.
        for kind in ("naive_rag", "map_reduce_summary", "query"):
            for status in ("failed", "cancelled"):
                failed = await outcome(kind, status)
                assert failed.outcome == LOST and f"run-1 {status}" in failed.error
        assert (await outcome("embeddings", "short")).outcome == LOST
        assert (await outcome("responses", "incomplete")).outcome == OK  # stopped at max_output_tokens
        stuck = await outcome("responses", "in_progress")
        assert stuck.outcome == LOST and "first response resp-1 in_progress" in stuck.error
    finally:
        await daemon.aclose()
    counts = progress([SoakRecord(0, "chat", started=True, outcome=OK), SoakRecord(1, "chat", started=True),
                       SoakRecord(2, "chat", started=True, outcome=DROPPED),
                       SoakRecord(3, "chat", started=True, outcome=LOST), SoakRecord(4, "chat")])
    assert counts == {"arrived": 4, "completed": 2, "errors": 1, "in_flight": 1, "lost": 1, "http_5xx": 0}


@pytest.mark.parametrize("flags, message", [
    (["soak", "naive_rag"], "the soak runs alone"),
    (["naive_rag", "--soak-seconds", "60"], "--soak-seconds belong to the soak"),
    (["soak", "--soak-seconds", "0"], "must be > 0"),
    (["soak", "--soak-rate", "-1"], "--soak-rate must be > 0"),
])
def test_bad_soak_flags_stop_before_anything_runs(flags, message, capsys, tmp_path):
    code = main(["bench", *flags, "--url", "http://127.0.0.1:9", "--out", str(tmp_path)])
    assert code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_started_daemon_is_sampled_by_its_own_pid(capsys, tmp_path):
    assert main(["bench", "soak", "--soak-pid", "1", "--out", str(tmp_path)]) == 2
    assert "--soak-pid goes with --url" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(600)  # a daemon's start, its warm-up and probe, a 60 s window (at 0.8 of the probed capacity: every kind arrives on a busy 2-core machine too) and the drain
def test_smoke_every_kind_completes_and_the_daemon_is_sampled(tmp_path):
    out = tmp_path / "soak"
    code = main(["bench", "soak", "--soak-seconds", "60", "--soak-sample-seconds", "5", "--soak-probe", "2",
                 "--max-tokens", "8", "--documents", "2", "--doc-tokens", "150", "--drain", "120",
                 "--config", str(ROOT / "configs" / "default.toml"), "--out", str(out)])
    soak = json.loads((out / "results.json").read_text())["soak"]
    c = soak["criteria"]
    assert code == (0 if c["passed"] else 1)  # a failed criterion is the command's failure
    assert soak["capacity"]["finished"] == 6 and soak["capacity"]["failed"] == 0
    assert soak["rate"] == pytest.approx(0.8 * soak["capacity"]["programs_per_s"])
    # Every kind arrived, and every arrival completed (a dropped stream as dropped): nothing lost, no 4xx or 5xx.
    assert soak["arrivals"] == soak["totals"]["arrivals"] >= len(KINDS)
    for kind, row in soak["kinds"].items():
        assert row["arrivals"] >= 1 and row["ok"] + row["dropped"] == row["arrivals"], (kind, row)
        assert row["dropped"] == 0 or kind == "chat_dropped"
    assert soak["kinds"]["chat_dropped"]["dropped"] >= 1  # a client did walk away mid-stream
    assert (c["lost_runs"]["value"], c["http_5xx"]["value"]) == (0, 0) and soak["errors"] == []
    assert c["lost_runs"]["passed"] and c["http_5xx"]["passed"]
    # The daemon served on after the drops: every workflow arrival is one run it finished, and nothing is left.
    runs = soak["daemon"]["workflow_runs"]
    assert runs.get("naive_rag") == {"succeeded": soak["kinds"]["naive_rag"]["ok"] + soak["kinds"]["query"]["ok"]}
    assert runs.get("map_reduce_summary") == {"succeeded": soak["kinds"]["map_reduce_summary"]["ok"]}
    assert c["drained"] == {"running": 0, "waiting": 0, "passed": True}
    # Samples from the idle start to the idle end, each with the daemon's RSS and descriptors.
    samples = soak["samples"]
    assert samples[0]["phase"] == "start" and samples[-1]["phase"] == "idle" and len(samples) >= 5
    assert all(s["rss_mib"] > 0 and s["fds"] > 0 and s["threads"] > 0 for s in samples)
    # Each sample also has what the host KV tier held (the default config's tiers are on) within its budget.
    assert all(0 <= s["host_tier_mib"] <= s["host_tier_budget_mib"] for s in samples)
    assert samples[0]["host_tier_budget_mib"] > 0 and soak["rss_net_of_host_tier"]["tier_budget_mib"] > 0
    assert all(s["malloc_in_use_mib"] > 0 and s["malloc_free_mib"] >= 0 for s in samples)  # glibc's figures
    # And the bounded caches that fill after the first minutes: every workflow run is kept (far below the bounds),
    # and the prefix cache held something at some point.
    workflow_ok = sum(soak["kinds"][k]["ok"] for k in ("naive_rag", "query", "map_reduce_summary"))
    assert samples[-1]["run_history_runs"] >= workflow_ok and samples[-1]["run_history_mib"] > 0
    assert all(0 <= s["prefix_cache_perc"] <= 100 for s in samples) and max(s["prefix_cache_perc"] for s in samples) > 0
    assert 0 < samples[-1]["store_cache_mib"] <= 256 + 64  # the soak's collection searched, within the bounds
    assert samples[-1]["completed"] == soak["arrivals"] and samples[-1]["in_flight"] == 0
    assert samples[0]["arrived"] == 0 and min(s["in_flight"] for s in samples) >= 0
    # The criteria are computed from those samples.
    rss, fds = c["rss_growth"], c["fds_flat"]
    assert rss["from_t_s"] >= soak["warmup_s"] == 10.0 and rss["to_mib"] == samples[-1]["rss_mib"]
    assert rss["growth"] == pytest.approx((rss["to_mib"] - rss["from_mib"]) / rss["from_mib"])
    assert (fds["first"], fds["last"]) == (samples[0]["fds"], samples[-1]["fds"])
    assert fds["max"] == max(s["fds"] for s in samples)
    text = (out / "results.txt").read_text()
    assert f"== soak: {soak['arrivals']} arrivals over 60 s" in text and "verdict: " in text
    assert "lost runs: 0 (limit 0): PASS" in text
    assert "(not judged) RSS less the host KV tier's bytes" in text
