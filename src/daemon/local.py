"""In-process use of the daemon's engines, for the command line: `headrace run` and `headrace profile`."""

from __future__ import annotations

import inspect
import json
import re
import time
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, AsyncIterator

import anyio
import torch

from headrace.daemon.collections import CollectionRegistry
from headrace.daemon.config import Config, ConfigError
from headrace.daemon.metrics import Metrics
from headrace.daemon.pool import EnginePool
from headrace.daemon.preload import Preloader
from headrace.graph.service import UnknownWorkflow, WorkflowService, timeline
from headrace.graph.workflow import WorkflowInputError
from headrace.plugins.manager import collect
from headrace.plugins.protocols import SamplingParams


@asynccontextmanager
async def engines(config: Config, only: set[str] | None = None) -> AsyncIterator[tuple[EnginePool, WorkflowService]]:
    """The config's engines loaded in this process, with a workflow service over them."""
    registry = collect()
    if only is not None:
        pinned = [name for name in config.residency.pinned if name in only]
        config = Config(server=config.server, data=config.data, batching=config.batching,
                        collections=config.collections, residency=replace(config.residency, pinned=pinned),
                        engines=[e for e in config.engines if e.name in only])
    pool = EnginePool(config, registry, Metrics())
    collections = CollectionRegistry(config.data.data_path())  # `headrace run` may search a collection too
    service = WorkflowService(registry.workflows, registry.passes, pool.resolve, pool.engines_by_kind,
                              pool.max_efficient_batch, policies=[*registry.batch_policies, *registry.llm_policies],
                              collections=collections.lookup, observer=pool.metrics,
                              calls=Preloader(pool, pool.metrics, config.residency, registry.workflows))
    async with anyio.create_task_group() as tg:
        await tg.start(pool.run)
        while not pool.ready:
            failed = [f"{s.name}: {s.error}" for s in pool.slots.values() if s.state == "failed"]
            if failed:
                raise ConfigError("engines", "failed to load: " + "; ".join(failed))
            await anyio.sleep(0.05)
        service.task_group = tg
        yield pool, service
        tg.cancel_scope.cancel()


def parse_inputs(pairs: list[str], schema: dict[str, Any]) -> dict[str, Any]:
    """``key=value`` pairs: a value is JSON if it parses, ``@path`` reads a file; repeated keys make a list."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise WorkflowInputError(f"--input {pair}", "expected key=value")
        if raw.startswith("@"):
            try:
                value: Any = Path(raw[1:]).read_text()
            except (OSError, UnicodeDecodeError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                raise WorkflowInputError(f"--input {key}", f"cannot read {raw[1:]}: {reason}") from None
        else:
            try:
                value = json.loads(raw)
            except json.JSONDecodeError:
                value = raw
        if schema.get(key, {}).get("type") == "string" and not isinstance(value, str):
            value = raw  # "42" for a string field stays a string
        if key in out:
            out[key] = (out[key] if isinstance(out[key], list) else [out[key]]) + [value]
        elif schema.get(key, {}).get("type") == "array" and not isinstance(value, list):
            out[key] = [value]
        else:
            out[key] = value
    return out


async def run_workflow(config: Config, name: str, pairs: list[str], run_config: dict[str, Any]) -> int:
    workflow = collect().workflows.get(name)
    if workflow is None:
        raise UnknownWorkflow(name)
    inputs = parse_inputs(pairs, workflow.inputs)
    workflow.validate(inputs, run_config)  # a bad input fails before any model loads
    async with engines(config) as (_, service):
        run = await service.run(name, inputs, run_config)
    print(json.dumps({"status": run.status, "result": run.result, "error": run.error}, indent=2, default=repr))
    print(f"\n{'node':<34} {'key':<8} {'engine':<18} {'start':>8} {'end':>8}")
    for r in timeline(run):
        key = ",".join(map(str, r["key"]))
        print(f"{r['node']:<34} {key:<8} {r['engine'] or '-':<18} {r['start']:>8.3f} {(r['end'] or 0):>8.3f}")
    return 0 if run.status == "succeeded" else 1


def _sentences(n: int) -> list[str]:
    """Real text for profiling: the standard library's docstrings, split into sentences."""
    import collections
    import json as json_module
    import statistics

    text = " ".join(inspect.getdoc(m) or "" for m in (inspect, collections, json_module, statistics, re, time))
    found = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if 20 < len(s.strip()) < 300]
    return (found * (n // max(1, len(found)) + 1))[:n]


async def profile(config: Config, name: str, max_batch: int = 256) -> int:
    """Throughput at growing batch sizes until it stops rising: the engine's max efficient batch size."""
    async with engines(config, only={name} | set(_dependencies(config, name))) as (pool, _):
        engine = pool.slots[name].engine
        print(f"profiling {name} ({engine.kind}): items/s by batch size")
        best, best_size, stalls, size = 0.0, 1, 0, 1
        if engine.kind == "vector_store":  # searches need rows to search
            await engine.ingest(PROFILE_TABLE, torch.randn(PROFILE_ROWS, PROFILE_DIM),
                                [{"text": f"row {i}"} for i in range(PROFILE_ROWS)])
        try:
            while size <= max_batch and stalls < 2:
                rate = await _rate(engine, size)
                gain = rate / best if best else float("inf")
                print(f"  batch {size:>4}: {rate:10.1f}/s" + ("" if best == 0 else f"   x{gain:.2f}"))
                if rate > best * 1.05:
                    best, best_size, stalls = rate, size, 0
                else:
                    stalls += 1
                size *= 2
        finally:
            if engine.kind == "vector_store":
                await engine.drop(PROFILE_TABLE)
    print(f"\nmax efficient batch size for {name}: {best_size}\n"
          f"set it with:\n  [engines.batching]\n  max_efficient_batch_size = {best_size}")
    return 0


def _dependencies(config: Config, name: str) -> list[str]:
    entry = config.engine(name)
    return [entry.options["llm"]] if "llm" in entry.options else []


# The vector store is profiled on a scratch table of random rows at all-MiniLM's width.
PROFILE_TABLE, PROFILE_ROWS, PROFILE_DIM = "profile_scratch", 4096, 384


async def _rate(engine: Any, size: int) -> float:
    items = _sentences(size)
    rounds = max(1, 64 // size)
    start = time.perf_counter()
    for _ in range(rounds):
        if engine.kind == "embed":
            await engine.embed(items)
        elif engine.kind == "rerank":
            await engine.score_pairs([("what is this about?", s) for s in items])
        elif engine.kind == "vector_store":  # a batch of query vectors, k as the RAG workflows ask
            await engine.search(PROFILE_TABLE, torch.randn(size, PROFILE_DIM), 16)
        elif engine.kind == "llm":
            async with anyio.create_task_group() as tg:
                for s in items:
                    tokens = engine.chat_tokens([{"role": "user", "content": s}])
                    tg.start_soon(_drain, engine.generate(tokens, SamplingParams(max_tokens=16, temperature=0)))
        else:
            raise ConfigError(f"engines.{engine.name}", f"cannot profile a {engine.kind} engine")
    return size * rounds / (time.perf_counter() - start)


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass
