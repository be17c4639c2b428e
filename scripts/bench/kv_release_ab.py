#!/usr/bin/env python3
"""What handing a freed KV stream's pages back costs a busy engine (issue 50): one llama-cpp engine in this
process (the shipped SmolLM2, a stream per sequence, 32 contexts), rounds of N concurrent greedy decodes of
128 tokens on chat prompts sharing a system prompt (so each request's stream starts as a copy of a cached
prefix's cells), with freed streams released (as shipped, ``lazy_kv.StreamLayout``) or kept resident,
the two interleaved round by round on the same engine (this VM's speed drifts within minutes).

    python scripts/bench/kv_release_ab.py [--streams 16] [--rounds 6]

Prints each round's tok/s and the KV resident after it, the medians, and released / kept.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import anyio

from headrace.plugins.engines.llama_cpp.engine import LlamaCppLLM
from headrace.plugins.engines.llama_cpp.lazy_kv import resident_bytes
from headrace.plugins.protocols import EngineEnv, EngineSpec, SamplingParams

TOPICS = ["rivers", "moons", "bridges", "castles", "deserts", "glaciers", "volcanoes", "forests", "islands",
          "canals", "lighthouses", "railways", "harbours", "mountains", "lakes", "caves"]
SYSTEM = "You are a helpful assistant who writes long, detailed answers. " * 8


async def measure(engine: LlamaCppLLM, streams: int, rounds: int) -> dict[str, list[float]]:
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    results: dict[str, list[float]] = {"released": [], "kept": []}
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        core = engine.core
        layout = core._streams  # None: this engine releases no stream (a unified KV, an unknown layout)
        if layout is None:
            raise SystemExit("this engine's KV streams are not released: nothing to compare")
        for n in range(rounds):
            mode = "released" if n % 2 == 0 else "kept"
            core._streams = layout if mode == "released" else None  # kept: the engine as before the release
            prompts = [engine.chat_tokens([{"role": "system", "content": SYSTEM},
                                           {"role": "user", "content": f"Tell me about {TOPICS[i % 16]} ({n})."}])
                       for i in range(streams)]
            counts: list[int] = []

            async def one(prompt: list[int]) -> None:
                tokens = 0
                async for delta in engine.generate(prompt, params):
                    tokens += len(delta.token_ids)
                counts.append(tokens)

            start = time.perf_counter()
            async with anyio.create_task_group() as round_group:
                for prompt in prompts:
                    round_group.start_soon(one, prompt)
            rate = sum(counts) / (time.perf_counter() - start)
            results[mode].append(rate)
            print(f"round {n} {mode:8s} {rate:6.1f} tok/s, KV resident after it "
                  f"{resident_bytes(core.kv_released) / 2**20:5.0f} MiB", flush=True)
        core._streams = layout
        tg.cancel_scope.cancel()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    env = EngineEnv(data_dir=Path(tempfile.mkdtemp(prefix="kv-release-")),
                    cache_dir=Path.home() / ".cache" / "headrace", lookup=lambda name: None,
                    observe_batch=lambda op, n, start, end: None)
    engine = LlamaCppLLM(EngineSpec(name="smollm2", plugin="llama-cpp",
                                    options={"threads": 2, "n_seq_max": 32, "max_batch_tokens": 512}), env)
    results = anyio.run(measure, engine, args.streams, args.rounds)
    for mode, rates in results.items():
        print(f"{mode:8s} median {statistics.median(rates):6.1f} tok/s over {len(rates)} rounds")
    print(f"released / kept: {statistics.median(results['released']) / statistics.median(results['kept']):.3f}x")


if __name__ == "__main__":
    main()
