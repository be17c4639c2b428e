"""The sentence-transformers embedder engine, against the model loaded directly."""

import threading
from pathlib import Path

import anyio
import pytest
import torch

from headrace.plugins.engines.retrieval import st_embed
from headrace.plugins.engines.models.paths import ModelNotFound, resolve_model
from headrace.plugins.protocols import EmbedEngine, EngineEnv, EngineSpec

from conftest import running

TEXTS = [
    "The cat sat on the mat.",
    "A feline rested on the rug.",
    "Quarterly revenue grew by twelve percent.",
    "headrace serves compound AI workflows",
    "",
]




def make_env(tmp_path: Path, seen: list) -> EngineEnv:
    return EngineEnv(
        data_dir=tmp_path, cache_dir=tmp_path, lookup=lambda name: None, observe_batch=lambda op, n, start, end: seen.append((op, n))
    )


def test_registers_its_kind():
    found = {}
    st_embed.register_engines(register=lambda kind, factory: found.setdefault(kind, factory))
    assert found == {"sentence-transformers": st_embed.factory}


def test_missing_model_names_the_config_key(tmp_path):
    spec = EngineSpec(name="emb", plugin="sentence-transformers", model=str(tmp_path / "nope"))
    with pytest.raises(ModelNotFound, match=r"engines\.emb\.model"):
        st_embed.factory(spec, make_env(tmp_path, []))


@pytest.mark.slow
@pytest.mark.anyio
async def test_embeddings_match_sentence_transformers(tmp_path):
    from sentence_transformers import SentenceTransformer

    seen: list = []
    # float32 pinned: compared with sentence-transformers' float32 at float32's tolerance ("auto" is bfloat16 on
    # a CPU with bf16 kernels; test_packed_batches_equal_one_at_a_time covers bfloat16).
    spec = EngineSpec(name="emb", plugin="sentence-transformers",
                      options={"batch_size": 2, "threads": 2, "dtype": "float32"})
    engine = st_embed.factory(spec, make_env(tmp_path, seen))
    assert isinstance(engine, EmbedEngine)
    reference = SentenceTransformer(str(resolve_model(st_embed.DEFAULT_MODEL)), device="cpu")

    async with running(engine):
        assert engine.dimensions == 384
        got = await engine.embed(TEXTS)
        one = await engine.embed(TEXTS[:1])
        empty = await engine.embed([])
        tokens = engine.count_tokens(TEXTS[:2])

    assert got.shape == (len(TEXTS), 384) and got.dtype == torch.float32
    assert torch.allclose(got.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)
    want = reference.encode(TEXTS, convert_to_tensor=True, normalize_embeddings=True).float()
    assert (torch.nn.functional.cosine_similarity(got, want) > 0.99).all()
    assert torch.allclose(one[0], got[0], atol=1e-5)
    assert empty.shape == (0, 384)
    # Paraphrases land closer than unrelated text.
    assert got[0] @ got[1] > got[0] @ got[2]
    # One observation per call, with its batch size; none for the empty call.
    assert seen == [("embed", len(TEXTS)), ("embed", 1)]
    # [CLS] + words + [SEP] for each text.
    assert tokens == sum(len(reference.tokenizer(t)["input_ids"]) for t in TEXTS[:2])
    # Out of run(), the model is released.
    with pytest.raises(RuntimeError, match="not running"):
        await engine.embed(["x"])


@pytest.mark.slow
@pytest.mark.anyio
async def test_concurrent_embeds_and_token_counts(tmp_path):
    """Batches run one at a time while count_tokens runs alongside on the loop."""
    engine = st_embed.factory(EngineSpec(name="emb", plugin="sentence-transformers"), make_env(tmp_path, []))
    results = {}

    async with running(engine):

        async def one(i):
            results[i] = await engine.embed([f"text number {i} " * 30] * 8)

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, i)
            for _ in range(50):
                assert engine.count_tokens(["text number 1 " * 30] * 8) > 0
                await anyio.sleep(0)

    assert sorted(results) == [0, 1, 2, 3]
    assert all(r.shape == (8, 384) for r in results.values())


@pytest.mark.anyio
async def test_a_batch_runs_on_a_thread_that_ends_with_it(tmp_path):
    """torch's OpenMP pool lives as long as the thread that made it, and a pool left parked beside llama.cpp's makes
    libgomp's waiters stop spinning (``own_thread``): each batch's thread is gone when its embeddings are back."""
    engine = st_embed.factory(EngineSpec(name="emb", plugin="sentence-transformers"), make_env(tmp_path, []))
    threads = []
    encode = engine._encode
    engine._encode = lambda model, texts: (threads.append(threading.current_thread()), encode(model, texts))[1]
    async with running(engine):
        for _ in range(2):
            vectors = await engine.embed(["a long enough text to be worth parallel work " * 40] * 16)
            assert vectors.shape == (16, 384)
            assert not threads[-1].is_alive()
    assert len(threads) == 2 and threads[0] is not threads[1]


def test_pack_keeps_sequences_apart():
    from headrace.plugins.engines.retrieval.packing import pack

    (batch,) = pack([[1, 2, 3], [4, 5], [6, 7, 8, 9]], row_tokens=6, dtype=torch.float32, width_multiple=1)
    # First fit, longest first: [6..9] + [4, 5] share a row, [1, 2, 3] gets its own.
    assert batch.members == [2, 1, 0]
    assert batch.spans == [(0, 0, 4), (0, 4, 2), (1, 0, 3)]
    assert batch.input_ids[0].tolist() == [6, 7, 8, 9, 4, 5]
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1]
    allowed = batch.attention_mask[0, 0] == 0
    assert allowed[0, :4].all() and not allowed[0, 4:].any()
    assert allowed[5, 4:].all() and not allowed[5, :4].any()


def test_pack_makes_few_shapes_and_holds_every_sequence_once():
    """Widths rounded up to the multiple and rows in power-of-two batches: whatever the lengths, the model
    sees a bounded set of input shapes (each new one costs oneDNN memory and a kernel build)."""
    import random

    from headrace.plugins.engines.retrieval.packing import pack

    rng, shapes = random.Random(0), set()
    for _ in range(300):
        sequences = [[7] * rng.randint(2, 200) for _ in range(rng.randint(1, 32))]
        batches = pack(sequences, row_tokens=128, dtype=torch.float32, width_multiple=16)
        assert sorted(i for b in batches for i in b.members) == list(range(len(sequences)))
        for b in batches:
            rows, width = b.input_ids.shape
            assert width % 16 == 0 and rows & (rows - 1) == 0
            shapes.add((rows, width))
            for i, (r, start, n) in zip(b.members, b.spans):
                assert n == len(sequences[i]) and start + n <= width
                assert (b.attention_mask[r, 0, start:start + n, start:start + n] == 0).all()
    assert len(shapes) <= 6 * 13  # 1..32 rows: 6 group sizes; widths 16..208: 13


@pytest.mark.slow
@pytest.mark.anyio
async def test_the_model_sees_few_shapes_however_long_the_texts(tmp_path):
    import random

    engine = st_embed.factory(EngineSpec(name="emb", plugin="sentence-transformers"), make_env(tmp_path, []))
    rng, words, shapes = random.Random(1), "rivers mills wheels water carries the to a".split(), set()
    async with running(engine):
        model = engine._model[0].auto_model
        forward = model.forward
        model.forward = lambda input_ids, **kw: (shapes.add(tuple(input_ids.shape)), forward(input_ids, **kw))[1]
        for _ in range(60):
            texts = [" ".join(rng.choices(words, k=rng.randint(1, 150))) for _ in range(rng.randint(1, 12))]
            vectors = await engine.embed(texts)
            assert vectors.shape == (len(texts), 384)
    assert engine._packed and all(width % 16 == 0 and rows & (rows - 1) == 0 for rows, width in shapes)
    assert len(shapes) <= 4 * 10  # 1-12 rows: groups of 1, 2, 4, 8; widths 16..160


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("dtype, floor", [("float32", 0.99999), ("bfloat16", 0.999)])
async def test_packed_batches_equal_one_at_a_time(tmp_path, dtype, floor):
    """Padding-free packing gives each text the embedding it gets alone."""
    from sentence_transformers import SentenceTransformer

    texts = ["short", "a somewhat longer sentence about rivers and mills", "mid length text here",
             "x " * 100, "The headrace carries water to the wheel."]
    spec = EngineSpec(name="emb", plugin="sentence-transformers", options={"dtype": dtype, "pack_tokens": 64})
    engine = st_embed.factory(spec, make_env(tmp_path, []))
    reference = SentenceTransformer(str(resolve_model(st_embed.DEFAULT_MODEL)), device="cpu")
    async with running(engine):
        assert engine._packed
        together = await engine.embed(texts)
        alone = torch.cat([await engine.embed([t]) for t in texts])
    direct = reference.encode(texts, convert_to_tensor=True, normalize_embeddings=True)
    assert (together * alone).sum(-1).min() > floor
    assert (together * direct).sum(-1).min() > floor


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_lone_surrogate_gets_a_clear_error(tmp_path):
    """A text the tokenizer cannot take fails its call with a ValueError naming it; the engine serves on."""
    engine = st_embed.factory(EngineSpec(name="emb", plugin="sentence-transformers"), make_env(tmp_path, []))
    async with running(engine):
        with pytest.raises(ValueError, match="text 1 is not valid Unicode"):
            await engine.embed(["fine", "bad \ud800 text"])
        with pytest.raises(ValueError, match="not valid Unicode"):
            engine.count_tokens(["\udfff"])
        assert (await engine.embed(["fine"])).shape == (1, 384)


@pytest.mark.gpu
@pytest.mark.anyio
@pytest.mark.parametrize("pack_tokens", [128, 0], ids=["packed", "encode"])
async def test_on_a_gpu_embeddings_stay_on_the_device_between_engines(tmp_path, pack_tokens):
    """DyOrc §6.2 on one device: the embedder's batch stays on the GPU, each request gets a view of it (no host
    round trip, no copy), a consumer on the same device reads it in place, and only a host consumer (the vector
    store) pays, and counts, one transfer."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from headrace.batching.policies import FifoPolicy
    from headrace.batching.requests import EmbedRequest, runner_for
    from headrace.batching.scheduler import BatchScheduler
    from headrace.plugins.engines.retrieval.handoff import HandoffStats, float32_rows

    docs = tuple(TEXTS[:4])
    options = {"device": "cuda", "dtype": "auto", "pack_tokens": pack_tokens}
    embedder = st_embed.factory(EngineSpec(name="emb", plugin="sentence-transformers", options=options),
                                make_env(tmp_path, []))
    on_cpu = st_embed.factory(EngineSpec(name="cpu", plugin="sentence-transformers", options={"dtype": "float32"}),
                              make_env(tmp_path, []))
    embeds = BatchScheduler("emb", runner_for(embedder), FifoPolicy(), max_batch_size=8, max_wait_ms=200)
    got: dict[str, torch.Tensor] = {}

    async def embed(key: str, texts: tuple[str, ...]) -> None:
        got[key] = await embeds.submit(EmbedRequest(texts), len(texts))

    async with running(embedder, on_cpu):
        assert embedder._packed == bool(pack_tokens)
        async with anyio.create_task_group() as tg:
            await tg.start(embeds.run)
            async with anyio.create_task_group() as both:  # queued together: one batch, two views
                both.start_soon(embed, "docs", docs)
                both.start_soon(embed, "question", ("How much did quarterly revenue grow?",))
            tg.cancel_scope.cancel()
        reference = await on_cpu.embed(docs)

    doc_vectors, question = got["docs"], got["question"]
    for vectors in (doc_vectors, question):
        assert vectors.device.type == "cuda" and vectors.dtype == torch.float32
    assert doc_vectors.untyped_storage().data_ptr() == question.untyped_storage().data_ptr()
    scores = question @ doc_vectors.T  # a consumer on the same device: read in place
    assert scores.device.type == "cuda" and int(scores.argmax()) == 2
    stats = HandoffStats()
    host = float32_rows(doc_vectors, stats)  # the vector store's side: one counted transfer
    assert host.device.type == "cpu" and stats.copied_bytes == stats.received_bytes == doc_vectors.numel() * 4
    # The same embeddings as float32 on the CPU, up to a half type's rounding.
    assert (host * reference).sum(-1).min() > 0.99
