"""The mixed benchmark (``headrace bench mixed``): its drawn program mix, its flags, and a smoke run on the real
default engines in which every program of every kind completes and the counts agree with one another and with the
daemon's."""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest

from conftest import API_KEY
from headrace.bench.corpus import build_corpus
from headrace.bench.mixed import KINDS, SHAPES, MixProgram, ProgramRecord, draw_mix, quotas
from headrace.bench.mixed_phase import ratios, summarize
from headrace.cli import main

MODES = ["per-request", "program-aware"]


def test_the_mix_is_drawn_from_the_seed_in_exact_shares_with_heavy_tailed_sizes():
    corpus = build_corpus(0, n_documents=2, min_tokens=300, count_tokens=lambda text: len(text.split()))
    shape = SHAPES["full"]
    snippets = [f"result {i}" for i in range(8)]
    programs = draw_mix(60, shape, corpus, snippets, seed=3)
    assert programs == draw_mix(60, shape, corpus, snippets, seed=3)  # every mode serves the same programs
    assert programs != draw_mix(60, shape, corpus, snippets, seed=4)
    assert [p.index for p in programs] == list(range(60))
    kinds = Counter(p.kind for p in programs)
    assert kinds == {"chat": 24, "naive_rag": 15, "map_reduce_summary": 9, "agent": 6, "client_agent": 6}
    assert [p.kind for p in programs[:12]] != sorted(p.kind for p in programs[:12])  # shuffled, not in blocks
    assert quotas(shape.shares, 7) == {"chat": 3, "naive_rag": 2, "map_reduce_summary": 1, "agent": 1,
                                       "client_agent": 0}
    assert sum(quotas(shape.shares, 61).values()) == 61
    big = draw_mix(3000, shape, corpus, snippets, seed=5)
    chats = Counter(p.max_tokens for p in big if p.kind == "chat")
    assert set(chats) == set(shape.chat_tokens) and chats[16] > chats[64] > chats[256] > 0  # most short, a few long
    steps = Counter(p.max_steps for p in big if p.kind == "agent")
    assert set(steps) <= set(range(2, 9)) and steps[2] > steps[5] > steps[8] > 0
    agents = [p.agent for p in big if p.kind == "client_agent"]
    assert all(a is not None and 2 <= a.turns <= 12 for a in agents) and len({a.index for a in agents}) == len(agents)
    smoke = Counter(p.kind for p in draw_mix(5, SHAPES["smoke"], corpus, snippets, seed=0))
    assert smoke == {kind: 1 for kind in KINDS}


def test_a_program_that_did_not_finish_counts_against_its_mode_not_for_it():
    programs = [MixProgram(0, "chat", 0, max_tokens=16), MixProgram(1, "agent", 1, max_steps=3),
                MixProgram(2, "chat", 2, max_tokens=16)]
    records = [ProgramRecord(0, "chat", 2.0), ProgramRecord(1, "agent", None, error="not finished when the drain "
                                                                                      "time ran out"),
               ProgramRecord(2, "chat", 4.0)]
    row = summarize(programs, records, [1.0, 2.0, 3.0], 0.5, {})
    assert (row["arrivals"], row["completed"], row["mean_s"], row["max_s"]) == (3, 2, 3.0, 4.0)
    assert row["kinds"]["agent"] == {"arrivals": 1, "completed": 0, "mean_s": None, "p50_s": None, "p95_s": None,
                                     "max_s": None}
    assert row["errors"] == ["not finished when the drain time ran out"]
    # The window runs from the first arrival (1 s) to the last finish (3 + 4 s): two programs in 6 s.
    assert row["window_s"] == 6.0 and row["throughput"] == pytest.approx(2 / 6)
    assert [p["program"] for p in row["longest_programs"]] == [2, 0] and row["longest_programs"][0]["size"] == 1
    base = {**row, "mean_s": 6.0, "p95_s": 8.0, "throughput": 1 / 6}
    versus = ratios({"per-request": base, "program-aware": row})["program-aware"]
    assert versus["mean"] == 2.0 and versus["throughput"] == pytest.approx(2.0)
    assert versus["kinds_mean"] == {"chat": 1.0, "agent": None}


@pytest.mark.parametrize("flags, message", [
    (["mixed", "--mixed-modes", "per-request", "headrace-deadline"], "unknown mixed mode"),
    (["mixed", "--mixed-fractions"], "needs --mixed-fractions or --mixed-rates"),
    (["mixed", "--mixed-programs", "0"], "must be > 0"),
    # One letter from the SLO-based load's --mixed-rate: without the benchmark it is refused, not ignored.
    (["naive_rag", "--mixed-rates", "0.1"], "--mixed-rates belong to the mixed benchmark"),
])
def test_bad_mixed_flags_stop_before_anything_runs(flags, message, capsys, tmp_path):
    code = main(["bench", *flags, "--url", "http://127.0.0.1:9", "--out", str(tmp_path)])
    assert code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.timeout(900)  # a server's engines, a capacity probe and a load point in two modes
def test_smoke_every_program_completes_and_the_counts_agree(server, tmp_path):
    out = tmp_path / "mixed"
    # Twice the probed capacity: the five programs overlap, and the run stays short.
    code = main(["bench", "mixed", "--mixed-size", "smoke", "--mixed-programs", "5", "--mixed-fractions", "2",
                 "--mixed-modes", *MODES, "--documents", "2", "--doc-tokens", "300", "--drain", "300",
                 "--url", server.base_url, "--api-key", API_KEY, "--out", str(out)])
    assert code == 0
    mixed = json.loads((out / "results.json").read_text())["mixed_programs"]
    assert mixed["mix"] == {kind: 1 for kind in KINDS}
    assert mixed["shape"]["workflow_tokens"] == 4  # the smoke's workflows answer in 4 tokens, not their 24
    capacity = mixed["capacity"]
    assert capacity["programs_per_s"] > 0 and capacity["failed"] == 0 and capacity["finished"] == 5
    (point,) = mixed["points"]
    assert point["fraction"] == 2 and point["rate"] == pytest.approx(2 * capacity["programs_per_s"], rel=1e-3)
    assert list(point["modes"]) == MODES
    for mode, row in point["modes"].items():
        # Every program of every kind completed, and the per-kind counts add up to the whole.
        assert row["arrivals"] == row["completed"] == 5 and row["errors"] == [], (mode, row)
        assert {k: (v["arrivals"], v["completed"]) for k, v in row["kinds"].items()} == {k: (1, 1) for k in KINDS}
        latencies = [v["mean_s"] for v in row["kinds"].values()]
        assert row["mean_s"] == pytest.approx(sum(latencies) / 5) and row["max_s"] == pytest.approx(max(latencies))
        assert row["p50_s"] <= row["p95_s"] <= row["max_s"]
        assert row["longest_programs"][0]["seconds"] == pytest.approx(row["max_s"], abs=1e-3)  # the oldest wait
        # The daemon ran each workflow program once, to success, and answered every client agent's turn.
        assert row["daemon_workflow_runs"] == {w: {"succeeded": 1} for w in ("naive_rag", "map_reduce_summary",
                                                                             "agent")}
        assert row["client_agent_turns"] == row["client_agent_turns_planned"] >= 2
        # Each LLM request the daemon counted: the chat, the agent's turns and at least one per workflow run.
        assert row["daemon_requests"] >= 1 + row["client_agent_turns"] + 3
        # Not prefilled: every cached token (the cells' prefixes, retained contexts, the KV tiers), at least the hits.
        assert 0 < row["tokens_prefilled"] == row["daemon_prompt_tokens"] - row["cached_tokens"]
        assert row["prefix_hits"] <= row["prefix_queries"]
        assert 0 < row["throughput"] <= 5 / row["max_s"] + 1e-9 and row["window_s"] >= row["max_s"] - 1e-6
        assert len(row["longest_programs"]) == 3 and row["longest_turn"]["seconds"] > 0
    assert set(point["ratios"]) == {"program-aware"} and point["ratios"]["program-aware"]["mean"] > 0
    assert set(point["ratios"]["program-aware"]["kinds_mean"]) == set(KINDS)
    text = (out / "results.txt").read_text()
    assert "== mixed (smoke)" in text and "program-aware vs per-request" in text and "capacity" in text
    # The daemon's own LLM settings are back after the modes' switches.
    settings = httpx.patch(f"{server.base_url}/v1/engines/smollm2", json={},
                           headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert settings["llm_policy"] == "fifo" and settings["prefix_caching"] is True and settings["retention"] is True
