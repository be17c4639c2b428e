"""``headrace profile``: an engine's throughput at growing batch sizes, and its max efficient batch size.

The size where throughput stops rising is what ``[engines.batching] max_efficient_batch_size`` wants:
StageDecomposition splits a stage into batches that large (Ayo §5.1). Each kind of engine is driven
by a probe: what one call with a batch of items is, and any scratch state it needs.
"""

from __future__ import annotations

import collections
import inspect
import json
import re
import statistics
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
import torch

from headrace.daemon.config import Config, ConfigError
from headrace.daemon.local import engines
from headrace.plugins.protocols import SamplingParams

ITEMS = 128  # items per measured size at most: the same sentences at every size
PASS_SECONDS = 3.0
REPEATS = 3  # passes per size; the fastest counts (a busy machine only ever slows a pass down)
GAIN = 1.05  # a size counts as better when it beats the best so far by this much
STALLS = 2  # sizes in a row without gain end the search
# The vector store is searched in a scratch table of random rows at all-MiniLM's width.
SCRATCH_TABLE, SCRATCH_ROWS, SCRATCH_DIM = "profile_scratch", 4096, 384


@dataclass(frozen=True)
class Probe:
    call: Callable[[list[str]], Awaitable[Any]]  # one batch
    scratch: Callable[[], Any]  # an async context manager around the measurement


@asynccontextmanager
async def _nothing() -> AsyncIterator[None]:
    yield


def probe_for(engine: Any) -> Probe:
    kind = engine.kind
    if kind == "embed":
        return Probe(engine.embed, _nothing)
    if kind == "rerank":
        return Probe(lambda items: engine.score_pairs([("what is this about?", s) for s in items]), _nothing)
    if kind == "vector_store":  # a batch of query vectors, k as the RAG workflows ask
        @asynccontextmanager
        async def table() -> AsyncIterator[None]:
            await engine.ingest(SCRATCH_TABLE, torch.randn(SCRATCH_ROWS, SCRATCH_DIM),
                                [{"text": f"row {i}"} for i in range(SCRATCH_ROWS)])
            try:
                yield
            finally:
                await engine.drop(SCRATCH_TABLE)

        return Probe(lambda items: engine.search(SCRATCH_TABLE, torch.randn(len(items), SCRATCH_DIM), 16), table)
    if kind == "llm":  # concurrent requests: the engine batches them itself
        async def generate(items: list[str]) -> None:
            async with anyio.create_task_group() as tg:
                for s in items:
                    tokens = engine.chat_tokens([{"role": "user", "content": s}])
                    tg.start_soon(_drain, engine.generate(tokens, SamplingParams(max_tokens=16, temperature=0)))

        return Probe(generate, _nothing)
    raise ConfigError(f"engines.{engine.name}", f"cannot profile a {kind} engine")


async def profile(config: Config, name: str, max_batch: int = 256) -> int:
    """Throughput at doubling batch sizes until it stops rising: the engine's max efficient batch size."""
    async with engines(config, only={name} | set(_dependencies(config, name))) as (pool, _):
        engine = pool.slots[name].engine
        probe = probe_for(engine)
        print(f"profiling {name} ({engine.kind}): items/s by batch size, the best of {REPEATS} passes over up to {ITEMS} items")
        best, best_size, stalls, size = 0.0, 1, 0, 1
        async with probe.scratch():
            while size <= max_batch and stalls < STALLS:
                rate = await items_per_second(probe, size)
                print(f"  batch {size:>4}: {rate:10.1f}/s" + ("" if best == 0 else f"   x{rate / best:.2f}"))
                if rate > best * GAIN:
                    best, best_size, stalls = rate, size, 0
                else:
                    stalls += 1
                size *= 2
    print(f"\nmax efficient batch size for {name}: {best_size}\n"
          f"set it with:\n  [engines.batching]\n  max_efficient_batch_size = {best_size}")
    return 0


async def items_per_second(probe: Probe, size: int, repeats: int = REPEATS) -> float:
    start = time.perf_counter()
    await probe.call(sentences(size))  # warm-up: the first call at a shape allocates
    # Up to ITEMS items a pass, fewer for a slow engine (an LLM reranker): about PASS_SECONDS a pass.
    calls = max(1, min(ITEMS // size, int(PASS_SECONDS / max(time.perf_counter() - start, 1e-6))))
    items = sentences(calls * size)
    fastest = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(0, len(items), size):
            await probe.call(items[i : i + size])
        fastest = min(fastest, time.perf_counter() - start)
    return len(items) / fastest


def sentences(n: int) -> list[str]:
    """Real text for profiling: the standard library's docstrings, split into sentences."""
    text = " ".join(inspect.getdoc(m) or "" for m in (inspect, collections, json, statistics, re, time))
    found = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if 20 < len(s.strip()) < 300]
    return (found * (n // max(1, len(found)) + 1))[:n]


def _dependencies(config: Config, name: str) -> list[str]:
    entry = config.engine(name)
    return [entry.options["llm"]] if "llm" in entry.options else []


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass
