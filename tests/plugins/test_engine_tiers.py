"""The KV tiers of both built-in engines on the real SmolLM2 (llama.cpp, and torch in float32): a prefix evicted
from the cells is restored, not prefilled, and answers as a fresh prefill does; a restart finds what the last
engine saved; a corrupted file is dropped and the prompt still answers."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import numpy as np
import pytest

from llm_engines import text_of
from headrace.plugins.engines.llama_cpp.engine import LlamaCppLLM
from headrace.plugins.engines.torch_engine.engine import TorchLLM
from headrace.plugins.engines.kvreuse.prefix_cache import common_prefix
from headrace.plugins.protocols import EngineEnv, EngineSpec, SamplingParams

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/setup builds it)")

GREEDY = SamplingParams(max_tokens=8, temperature=0)
CACHE = Path.home() / ".cache" / "headrace"  # the converted model, shared with the other engine tests
# Small caches: a second prompt's prefix evicts the first's. llama.cpp: two contexts, one cached prefix
# sequence; torch: a cache of 400 tokens, in float32 (a restore must give the fresh prefill's bytes).
ENGINES = {
    "llama-cpp": (LlamaCppLLM, {"threads": 2, "n_seq_max": 2, "prefix_cache_sequences": 1, "max_context_tokens": 1024,
                                "max_batch_tokens": 256}),
    "torch": (TorchLLM, {"threads": 2, "dtype": "float32", "prefix_cache_tokens": 400}),
}
TIERS = {"kv_host_mib": 256, "kv_disk_mib": 256}


@pytest.fixture(params=list(ENGINES))
def plugin(request) -> str:
    return request.param


def make_engine(plugin: str, data_dir: Path, **options):
    cls, base = ENGINES[plugin]
    env = EngineEnv(data_dir=data_dir, cache_dir=CACHE, lookup=lambda name: None)
    return cls(EngineSpec(name="smollm2", plugin=plugin, options={**base, **TIERS, **options}), env)


def prompts(engine) -> tuple[list[int], list[int]]:
    """Two ~300-token chat prompts that share nothing past the template's first tokens."""
    def ask(topic: str) -> list[int]:
        text = " ".join(f"Note {i} on the {topic}: it was checked and found sound." for i in range(20))
        return engine.chat_tokens([{"role": "user", "content": f"{text}\nWhat was checked?"}])
    return ask("mill wheel"), ask("sluice gate")


async def serve(engine, scenario):
    with anyio.fail_after(600):
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            try:
                return await scenario()
            finally:
                tg.cancel_scope.cancel()


async def answer(engine, tokens: list[int]) -> tuple[str, int]:
    """The greedy answer and the prompt tokens prefilled for it."""
    before = engine.core.token_counts["prefill"]
    text = await text_of(engine.generate(tokens, GREEDY))
    return text, engine.core.token_counts["prefill"] - before


def test_an_evicted_prefix_is_restored_from_host_memory_and_answers_as_the_cells_would(tmp_path, plugin):
    engine = make_engine(plugin, tmp_path, kv_disk_mib=0)

    async def scenario():
        a, b = prompts(engine)
        # All but its last token whole blocks: the cells (to the token on llama-cpp) and the tiers (whole blocks)
        # reuse the same count, so their KV is byte for byte the same.
        a = a[: (len(a) - 1) // 16 * 16 + 1]
        fresh = await answer(engine, a)
        cached = await answer(engine, a)  # its prefix from the cells
        await answer(engine, b)  # b's prefix takes the cells' room: a's goes to host memory
        stats = engine.stats()
        restored = await answer(engine, a)
        return a, fresh, cached, stats, restored, engine.stats()

    a, fresh, cached, evicted, restored, stats = anyio.run(serve, engine, scenario)
    prefix = (len(a) - 1) // 16 * 16
    assert fresh[1] == len(a) and cached[1] == restored[1] == len(a) - prefix  # only the tail past the last block
    assert evicted["kv_store_host_puts"] >= 1 and evicted["kv_store_host_bytes"] > 0
    # Byte for byte the KV the cells held: the same greedy text as a hit in the cells. (A fresh prefill's may
    # differ on both engines: a prompt filled in two parts sums in another order, and rounds differently.)
    assert restored[0] == cached[0]
    assert stats["kv_store_host_hits"] == 1 and stats["kv_store_host_hit_tokens"] == prefix
    assert stats["kv_store_host_bytes"] <= stats["kv_store_host_capacity"]
    assert stats["kv_store_disk_capacity"] == 0 and not (tmp_path / "kv").exists()


def test_a_restart_finds_the_prefixes_saved_before_it_and_a_corrupted_file_is_dropped(tmp_path):
    # On llama.cpp (the files are engine-neutral: tests/plugins/test_kv_store.py; torch's bytes are tested above).
    plugin = "llama-cpp"
    first = make_engine(plugin, tmp_path)

    async def before_restart():
        a, b = prompts(first)
        a = a[: (len(a) - 1) // 16 * 16 + 1]  # the cells and the disk then reuse the same count (above)
        await answer(first, a)
        return a, b, await answer(first, a), await answer(first, b)  # a's second from the cells

    a, b, cached_a, fresh_b = anyio.run(serve, first, before_restart)  # stopping writes the cells' prefixes
    files = sorted((tmp_path / "kv" / "smollm2").glob("*.kv"))
    assert len(files) == 2, files
    # Corrupt b's file (the one holding b's tokens) in its payload: its checksum no longer matches.
    b_file = next(f for f in files if f.stat().st_size and _holds(f, b))
    with open(b_file, "r+b") as f:
        f.seek(-100, 2)
        f.write(b"\xff" * 50)

    second = make_engine(plugin, tmp_path)

    async def after_restart():
        return await answer(second, a), await answer(second, b), second.stats()

    restored_a, refilled_b, stats = anyio.run(serve, second, after_restart)
    assert restored_a[0] == cached_a[0] and restored_a[1] < 16  # from disk
    shared = common_prefix(a, b)  # the template's first tokens: a's entry in the cells holds them (to the token)
    assert refilled_b[0] == fresh_b[0] and refilled_b[1] == len(b) - shared  # the bad file dropped: prefilled
    assert stats["kv_store_disk_hits"] == 1 and stats["kv_store_files_dropped"] == 1


def _holds(path: Path, tokens: list[int]) -> bool:
    """The file's entry begins with the prompt's whole blocks (an entry holds a prompt, or a prompt and its answer)."""
    n = (len(tokens) - 1) // 16 * 16
    with open(path, "rb") as f:  # the file's own header names its token count; its ids follow it
        f.read(8)
        header = json.loads(f.read(int.from_bytes(f.read(4), "little")))
        ids = np.frombuffer(f.read(8 * header["tokens"]), dtype=np.int64).tolist()
    return ids[:n] == list(tokens[:n])
