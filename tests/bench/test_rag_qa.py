"""``headrace bench rag-qa``: the question set over the workflows' chunks, and a smoke run on the real model."""

from __future__ import annotations

import json

import pytest

from conftest import in_process
from headrace.bench.rag_qa import CONTEXTS, paired_interval, qa_prompts, render
from headrace.cli import main


def test_each_question_has_its_answer_in_one_of_its_chunks_at_a_seeded_place():
    prompts = qa_prompts()
    assert len(prompts) >= 100
    places = set()
    for p in prompts:
        assert len(p.contexts) == CONTEXTS
        holding = [i for i, c in enumerate(p.contexts) if p.item.gold in c and p.item.topic in c]
        assert holding, p.item.topic
        assert p.home in holding
        places.add(p.home)
    assert places == set(range(CONTEXTS))  # the answer is not always first
    assert [p.contexts for p in qa_prompts()] == [p.contexts for p in prompts]  # fixed by the seed
    assert [p.contexts for p in qa_prompts(1)] != [p.contexts for p in prompts]


def test_the_layouts_differ_only_in_order():
    from headrace.graph.prompts import document_marks

    p = qa_prompts()[0]
    frame = ("<head>", "<tail>")
    first, context_first, canonical = (render(p, m, frame) for m in ("question-first", "context-first", "canonical"))
    assert first.index(p.item.question) < first.index(p.contexts[0])
    assert context_first.index(p.item.question) > max(context_first.index(c) for c in p.contexts)
    assert sorted(first.split()) == sorted(context_first.split()) == sorted(canonical.split())
    assert all(t.startswith("<head>") and t.endswith("<tail>") for t in (first, context_first, canonical))
    # The pieces' layouts: each chunk's mark (tokenized alone there), the question before or after them.
    pieces, pieces_cf = (render(p, m, frame) for m in ("pieces", "pieces-context-first"))
    marks = document_marks(list(p.contexts))
    assert pieces.index(p.item.question) < pieces.index(marks[0])
    assert pieces_cf.index(p.item.question) > max(pieces_cf.index(m) for m in marks)
    # A leaf: the answer's chunk alone, in either order.
    leaf_first, leaf_context = (render(p, m, frame) for m in ("leaf-question-first", "leaf-context-first"))
    home = p.contexts[p.home]
    assert leaf_first.index(p.item.question) < leaf_first.index(home)
    assert leaf_context.index(p.item.question) > leaf_context.index(home)
    assert sorted(leaf_first.split()) == sorted(leaf_context.split())
    assert all(c not in leaf_first for i, c in enumerate(p.contexts) if c != home)


def test_the_paired_interval_brackets_the_mean_difference():
    d, lo, hi = paired_interval([0.0, 0.5, 1.0, 0.2], [0.5, 0.5, 1.0, 0.6])
    assert d == pytest.approx(0.225) and lo <= d <= hi
    same = paired_interval([0.3] * 5, [0.3] * 5)
    assert same == (0.0, 0.0, 0.0)


@pytest.mark.slow
def test_a_smoke_run_scores_every_mode(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/setup builds it)")
    out = tmp_path / "qa"
    result = in_process(main, "bench", "rag-qa", "--qa-questions", "1", "--qa-tokens", "6", "--out", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    summary = {r["mode"]: r for r in results["summary"]}
    assert list(summary) == ["question-first", "context-first", "canonical", "leaf-question-first",
                             "leaf-context-first"]
    for mode, rows in results["rows"].items():
        assert len(rows) == 1 and all(0 <= r["f1"] <= 1 and r["prompt_tokens"] > 150 for r in rows), mode
    leaf, whole = results["rows"]["leaf-question-first"][0], results["rows"]["question-first"][0]
    assert leaf["prompt_tokens"] < whole["prompt_tokens"]  # one chunk of three
    # Each mode against its own family's question-first layout.
    assert summary["context-first"]["f1_vs"] == "question-first" and "f1_vs" not in summary["question-first"]
    assert summary["leaf-context-first"]["f1_vs"] == "leaf-question-first"
    assert "f1_vs" not in summary["leaf-question-first"] and "CPU:" in (out / "results.md").read_text()
    bad = in_process(main, "bench", "rag-qa", "--qa-modes", "sideways", "--out", str(out))
    assert bad.returncode == 2 and "--qa-modes" in bad.stderr


def test_a_placed_run_scores_the_placement_against_the_same_tokens_prefilled(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/setup builds it)")
    out = tmp_path / "qa"
    result = in_process(main, "bench", "rag-qa", "--qa-questions", "2", "--qa-tokens", "6",
                        "--qa-modes", "question-first", "pieces", "placed", "pieces-context-first",
                        "placed-context-first", "--out", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    summary = {r["mode"]: r for r in results["summary"]}
    assert summary["placed"]["f1_vs"] == "pieces" and summary["pieces"]["f1_vs"] == "question-first"
    assert summary["placed-context-first"]["f1_vs"] == "pieces-context-first"
    # Every placed prompt (2 questions, both layouts) restored its three chunks' blocks past their first 16 tokens.
    placement = results["placement"]
    assert placement["placement_placements"] == 4 and placement["placement_fallbacks"] == 0
    assert placement["placement_placed_tokens"] > 4 * 3 * 64, placement
    assert "placed chunks from the KV tiers" in (out / "results.md").read_text()
