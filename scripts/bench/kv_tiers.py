#!/usr/bin/env python3
"""A prefix restored from the KV tiers against prefilling it through the engine (issue 42's 50x target).

For each prompt length (default 500 and 2,000 tokens), on the engine as the default config runs it (its
own options but room in the cells for one prompt, tiers on, a fresh data dir): the prompt prefilled with
nothing cached (``fresh``), then another prompt prefilled, which evicts its prefix from the cells to host
memory, and the same prompt prefilled again (``host``: restored, the tail past the last whole block prefilled), then
the engine stopped and started again on the same data dir and the prompt prefilled once more (``disk``:
read back from its file and restored). ``cells hit``: the prompt again right after its fresh prefill, its
prefix in the cells: the same tail to fill, so ``host`` less ``cells hit`` is what the restore costs. Each time is one ``engine.prefill`` call, as a request waits for it
(a free sequence, the restore, the tail, the logits), ``--repeat`` times with fresh prompts, medians.

    python scripts/bench/kv_tiers.py [--llm llama-cpp torch] [--tokens 500 2000] [--repeat 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import anyio

from benchlib import ROOT, CPUWatch, cpu_note, median, write_results  # beside this script


def engine_for(plugin: str, data_dir: Path, longest: int):
    from headrace.daemon.config import load_config
    from headrace.plugins.protocols import EngineEnv, EngineSpec

    config = load_config(ROOT / "configs" / ("default.toml" if plugin == "llama-cpp" else "torch.toml"))
    spec = next(e for e in config.engines if e.plugin == plugin)
    env = EngineEnv(data_dir=data_dir, cache_dir=config.data.cache_path(), lookup=lambda name: None)
    if plugin == "llama-cpp":
        from headrace.plugins.engines.llama_cpp.engine import LlamaCppLLM as cls
    else:
        from headrace.plugins.engines.torch_engine.engine import TorchLLM as cls
    # Room in the cells for one prompt: the next evicts it to the tiers, as a busy engine's would.
    room = {"prefix_cache_sequences": 1} if plugin == "llama-cpp" else {"prefix_cache_tokens": longest}
    return cls(EngineSpec(name=spec.name, plugin=plugin, model=spec.model, options={**spec.options, **room}), env)


def prompt(engine, n: int, seed: int) -> list[int]:
    words = " ".join(f"Entry {seed}.{i}: the gate at lock {i * 7 % 101} was opened at dawn." for i in range(n))
    return engine.chat_tokens([{"role": "user", "content": words}])[:n]


async def timed_prefill(engine, tokens: list[int]) -> tuple[float, int | None, float]:
    """The prefill call's seconds, the tokens it found cached, and the seconds the tiers spent restoring."""
    def restoring() -> float:
        stats = engine.stats()
        return sum(stats.get(f"kv_store_{tier}_restore_seconds", 0.0) for tier in ("host", "disk"))
    before = restoring()
    start = time.perf_counter()
    cached = await engine.prefill("bench", tokens)
    seconds = time.perf_counter() - start
    await engine.free("bench")
    return seconds, cached, restoring() - before


async def serving(engine, scenario):
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        try:
            return await scenario()
        finally:
            tg.cancel_scope.cancel()


def measure(plugin: str, lengths: list[int], repeat: int) -> dict:
    data = Path(tempfile.mkdtemp(prefix="kv-tiers-"))
    first = engine_for(plugin, data, max(lengths))
    prompts: dict[int, list[list[int]]] = {}
    times: dict[str, dict[int, list[float]]] = {"fresh": {}, "cells": {}, "host": {}, "disk": {}}
    cached: dict[str, dict[int, list[int]]] = {"host": {}, "disk": {}}
    restore: dict[str, dict[int, list[float]]] = {"host": {}, "disk": {}}  # the restore alone (read, set state)

    async def before_restart():
        for n in lengths:
            prompts[n] = [prompt(first, n, 1000 * n + r) for r in range(repeat)]
            for r, tokens in enumerate(prompts[n]):
                seconds, *_ = await timed_prefill(first, tokens)
                times["fresh"].setdefault(n, []).append(seconds)
                seconds, *_ = await timed_prefill(first, tokens)  # a hit in the cells: the same tail to prefill
                times["cells"].setdefault(n, []).append(seconds)
                await timed_prefill(first, prompt(first, n, 7 + r))  # another prompt: this one's prefix leaves
                # the cells for host memory
                seconds, hit, restoring = await timed_prefill(first, tokens)
                times["host"].setdefault(n, []).append(seconds)
                cached["host"].setdefault(n, []).append(hit or 0)
                restore["host"].setdefault(n, []).append(restoring)
        return first.stats()

    before = anyio.run(serving, first, before_restart)
    second = engine_for(plugin, data, max(lengths))

    async def after_restart():
        for n in lengths:
            for tokens in prompts[n]:
                seconds, hit, restoring = await timed_prefill(second, tokens)
                times["disk"].setdefault(n, []).append(seconds)
                cached["disk"].setdefault(n, []).append(hit or 0)
                restore["disk"].setdefault(n, []).append(restoring)
        return second.stats()

    after = anyio.run(serving, second, after_restart)
    rows = []
    for n in lengths:
        fresh = median(times["fresh"][n])
        row = {"tokens": n, "fresh_s": fresh, "cells_s": median(times["cells"][n])}
        for tier in ("host", "disk"):
            t = median(times[tier][n])
            r = median(restore[tier][n])
            row.update({f"{tier}_s": t, f"{tier}_x": fresh / t if t else None,
                        f"{tier}_restore_s": r, f"{tier}_restore_x": fresh / r if r else None,
                        f"{tier}_cached_tokens": median(cached[tier][n])})
        rows.append(row)
    return {"rows": rows, "bytes_per_token": before.get("kv_store_host_bytes", 0) /
            max(1, before.get("kv_store_host_hit_tokens", 0) or 1),
            "stats_before_restart": {k: v for k, v in before.items() if k.startswith("kv_store")},
            "stats_after_restart": {k: v for k, v in after.items() if k.startswith("kv_store")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llm", nargs="+", default=["llama-cpp"], choices=["llama-cpp", "torch"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[500, 2000])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "kv_tiers.json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    res: dict = {"command": " ".join(sys.argv), "engines": {}}
    for plugin in args.llm:
        cpu = CPUWatch()
        res["engines"][plugin] = measure(plugin, args.tokens, args.repeat)
        res["engines"][plugin]["cpu_cores"] = cpu.cores()
        print(f"{plugin}  ({cpu_note(res['engines'][plugin])})")
        print("prefill calls (the restore, then the tail past the last whole block), and [the restore alone]")
        print(f"{'tokens':>7} {'prefill':>9} {'cells hit':>9} {'host':>9} {'x':>7} {'disk':>9} {'x':>7} "
              f"{'[host':>9} {'x':>6} {'disk':>9} {'x]':>6}")
        for r in res["engines"][plugin]["rows"]:
            print(f"{r['tokens']:>7} {r['fresh_s'] * 1000:>7.1f}ms {r['cells_s'] * 1000:>7.2f}ms {r['host_s'] * 1000:>7.2f}ms {r['host_x']:>6.0f}x "
                  f"{r['disk_s'] * 1000:>7.2f}ms {r['disk_x']:>6.0f}x {r['host_restore_s'] * 1000:>7.2f}ms "
                  f"{r['host_restore_x']:>5.0f}x {r['disk_restore_s'] * 1000:>7.2f}ms {r['disk_restore_x']:>5.0f}x")
    write_results(res, args.out, t0)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
