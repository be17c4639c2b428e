#!/usr/bin/env python3
"""Model residency under a memory budget: a mixed stream over two LLMs and the embedder, four ways.

    python scripts/bench/residency.py [--tiny] [--requests N] [--config FILE] [--budget-bytes B] [--out FILE]

The stream (seeded) mixes naive_rag runs on the first LLM (embedder -> LanceDB -> LLM), plain chat
requests on the second LLM, and embedding requests, one at a time, in-process on one set of
engines per mode (configs/residency.toml by default: SmolLM2 on torch and on llama.cpp, the
embedder and LanceDB; its budget holds one of the two LLMs). Modes, each on a fresh pool:

  all-resident      no budget: every engine stays loaded (the upper bound; needs the memory)
  lru               the budget, loads on demand evicting the least recently used idle engine
  lru-markov        the same, plus Markov preloading of each run's predicted next engines
  load-per-request  the budget, and every evictable engine unloaded after each request: what a
                    one-model-per-process server pays on every switch

Figures per mode: end-to-end latency per request kind and overall (median, p90, mean), the
stream's wall time, cold-start waits (the load waits batches and requests saw: count and
seconds), loads and evictions, Markov prediction accuracy and preload hits. Ratios against
all-resident and lru come from one run of this script, never from two.
--tiny: 6 requests of 4 tokens, to check the script runs (its figures mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

import anyio
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
MODES = ("all-resident", "lru", "lru-markov", "load-per-request")
DOCS = ["The headrace is the channel that carries water from the river to the mill wheel.",
        "The tailrace carries the water away from the wheel, back to the river downstream.",
        "A sluice gate on the headrace sets how much water reaches the wheel."]
QUESTIONS = ["What carries water to the wheel?", "Where does the water go after the wheel?",
             "What sets how much water reaches the wheel?"]
CHATS = ["Name a river in Europe.", "Say hello in French.", "What is two plus two?", "Name a colour."]


def stream(n: int, seed: int) -> list[tuple[str, str]]:
    """(kind, text) items: rag 40%, chat 40%, embed 20%."""
    rng = random.Random(seed)
    kinds = rng.choices(["rag", "chat", "embed"], weights=[4, 4, 2], k=n)
    texts = {"rag": QUESTIONS, "chat": CHATS, "embed": DOCS}
    return [(kind, rng.choice(texts[kind])) for kind in kinds]


def summary(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"n": 0}
    ordered = sorted(xs)
    return {"n": len(xs), "median": statistics.median(xs), "p90": ordered[min(len(xs) - 1, int(0.9 * len(xs)))],
            "mean": statistics.fmean(xs)}


def sample(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``, read with prometheus_client's parser."""
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and labels.items() <= s.labels.items())


def mode_config(config, mode: str, budget: int | None):
    residency = config.residency
    if budget is not None:
        residency = dataclasses.replace(residency, budget_bytes=budget)
    if mode == "all-resident":
        residency = dataclasses.replace(residency, budget_bytes=0)
    residency = dataclasses.replace(residency, preload=mode == "lru-markov")
    return dataclasses.replace(config, residency=residency)


async def run_mode(config, mode: str, items: list[tuple[str, str]], max_tokens: int) -> dict:
    from headrace.batching.requests import EmbedRequest
    from headrace.daemon.local import engines
    from headrace.plugins.protocols import SamplingParams

    async with engines(config) as (pool, service):
        llms = [s.name for s in pool.slots.values() if s.engine.kind == "llm" and s.state == "ready"]
        embedder = pool.engines_by_kind()["embed"]
        if len(llms) < 2:
            raise SystemExit(f"the config serves {len(llms)} LLM(s); the benchmark needs two")
        rag_llm, chat_llm = llms[:2]
        before = pool.metrics.render().decode()
        latencies: dict[str, list[float]] = {"rag": [], "chat": [], "embed": []}
        start = time.perf_counter()
        for kind, text in items:
            t0 = time.perf_counter()
            if kind == "rag":
                run = await service.run("naive_rag", {"question": text, "documents": DOCS},
                                        {"max_tokens": max_tokens, "engines": {"llm": rag_llm}})
                if run.status != "succeeded":
                    raise RuntimeError(f"{mode}: naive_rag {run.status}: {run.error}")
            elif kind == "chat":
                engine = pool.resolve(chat_llm).engine
                tokens = engine.chat_tokens([{"role": "user", "content": text}])
                params = SamplingParams(max_tokens=max_tokens, temperature=0)
                async for _ in service.generate(chat_llm, tokens, params):
                    pass
            else:
                await pool.resolve(embedder).batch().submit(EmbedRequest((text,)), 1)
            latencies[kind].append(time.perf_counter() - t0)
            if mode == "load-per-request":
                await pool.unload_idle()
        wall = time.perf_counter() - start
        after = pool.metrics.render().decode()

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    predictions = delta("headrace_markov_predictions_total")
    return {
        "llms": {"rag": rag_llm, "chat": chat_llm},
        "budget_bytes": config.residency.budget_bytes,
        "wall_s": wall,
        "e2e_s": {kind: summary(xs) for kind, xs in latencies.items()} | {"all": summary(sum(latencies.values(), []))},
        "cold_start_waits": {"count": delta("headrace_engine_load_wait_seconds_count"),
                             "seconds": delta("headrace_engine_load_wait_seconds_sum")},
        "loads": delta("headrace_engine_loads_total"),
        "evictions": delta("headrace_engine_evictions_total"),
        "preloads": delta("headrace_preloads_total"),
        "preload_hits": delta("headrace_preload_hits_total"),
        "prediction_accuracy": (delta("headrace_markov_predictions_correct_total") / predictions
                                if predictions else None),
        "peak_resident_bytes": pool.peak_resident_bytes,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "residency.toml")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--budget-bytes", type=int, default=None, help="instead of the config's [residency] budget")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--data-dir", type=Path, default=None, help="the runs' LanceDB directory (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "residency.json")
    args = parser.parse_args()
    if args.tiny:
        args.requests, args.max_tokens = 6, 4

    import tempfile

    from headrace.daemon.config import load_config

    with tempfile.TemporaryDirectory() as tmp:
        data = str(args.data_dir or tmp)
        config = load_config(args.config, env={}, overrides={"data.dir": data})
        items = stream(args.requests, args.seed)
        results = {"config": str(args.config), "requests": args.requests, "max_tokens": args.max_tokens,
                   "tiny": args.tiny, "stream": [kind for kind, _ in items], "modes": {}}
        for mode in args.modes:
            print(f"mode {mode} ...", file=sys.stderr, flush=True)
            results["modes"][mode] = anyio.run(run_mode, mode_config(config, mode, args.budget_bytes), mode, items,
                                               args.max_tokens)
    modes = results["modes"]
    for base in ("all-resident", "lru"):
        if base in modes:
            for mode, res in modes.items():
                res[f"mean_e2e_vs_{base}"] = res["e2e_s"]["all"]["mean"] / modes[base]["e2e_s"]["all"]["mean"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"{'mode':18} {'mean e2e s':>10} {'p90 s':>7} {'cold waits':>10} {'wait s':>7} {'loads':>5} "
          f"{'accuracy':>8} {'hits':>4}")
    for mode, res in modes.items():
        acc = res["prediction_accuracy"]
        print(f"{mode:18} {res['e2e_s']['all']['mean']:10.3f} {res['e2e_s']['all']['p90']:7.3f} "
              f"{res['cold_start_waits']['count']:10.0f} {res['cold_start_waits']['seconds']:7.2f} "
              f"{res['loads']:5.0f} {'-' if acc is None else f'{acc:.2f}':>8} {res['preload_hits']:4.0f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
