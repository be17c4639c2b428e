#!/usr/bin/env python3
"""Model residency under a memory budget: a mixed stream over two LLMs and the embedder, four ways.

    python scripts/bench/residency_modes.py [--tiny] [--workload chat|documents] [--requests N] [--config FILE]
                                      [--budget-bytes B] [--out FILE]

The stream (seeded) is served one request at a time, in-process on one set of engines per mode
(configs/residency.toml by default: SmolLM2 on torch and on llama.cpp, the embedder and LanceDB;
its budget holds one of the two LLMs). Two workloads:

  chat       naive_rag runs on the first LLM over three short documents (embedder -> LanceDB ->
             LLM), plain chat requests on the second LLM, and embedding requests. A switch of LLM
             comes with the request's first call, so a load has nothing to hide behind.
  documents  naive_rag runs over the request's own document (--doc-tokens, from the benchmark
             corpus: chunked, embedded and indexed by the run before its question is searched),
             on the first LLM or the second (two tenants, one model each), and embedding
             requests: a run's LLM is needed only after its indexing, which a preload can hide
             behind.

Modes, each on a fresh pool:

  all-resident      no budget: every engine stays loaded (the upper bound; needs the memory)
  lru               the budget, loads on demand evicting the least recently used idle engine
  lru-markov        the same, plus Markov preloading of the engines each run is predicted to call
                    within its next preload_steps calls
  lru-markov-next   (only with --modes) the same, predicting only each run's next call
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
EXTRA_MODES = ("lru-markov-next",)  # on request: preloading only the next call's engines (preload_steps = 1)
DOCS = ["The headrace is the channel that carries water from the river to the mill wheel.",
        "The tailrace carries the water away from the wheel, back to the river downstream.",
        "A sluice gate on the headrace sets how much water reaches the wheel."]
QUESTIONS = ["What carries water to the wheel?", "Where does the water go after the wheel?",
             "What sets how much water reaches the wheel?"]
CHATS = ["Name a river in Europe.", "Say hello in French.", "What is two plus two?", "Name a colour."]


@dataclasses.dataclass(frozen=True)
class Item:
    kind: str  # rag (first LLM), rag2 (second LLM), chat (second LLM), embed
    text: str  # the question, chat message or text to embed
    documents: tuple[str, ...] = ()  # a rag run's own documents


def stream(n: int, seed: int, workload: str = "chat", doc_tokens: int = 4000) -> list[Item]:
    """40% on each LLM, 20% embeddings, in a seeded order."""
    rng = random.Random(seed)
    second = "chat" if workload == "chat" else "rag2"
    kinds = rng.choices(["rag", second, "embed"], weights=[4, 4, 2], k=n)
    if workload == "chat":
        texts = {"rag": QUESTIONS, "chat": CHATS, "embed": DOCS}
        return [Item(kind, rng.choice(texts[kind]), tuple(DOCS) if kind == "rag" else ()) for kind in kinds]
    from headrace.bench.corpus import build_corpus

    corpus = build_corpus(seed, n_documents=4, n_questions=16, min_tokens=doc_tokens, max_tokens=doc_tokens * 5 // 4)
    items = []
    for kind in kinds:
        if kind == "embed":
            items.append(Item(kind, rng.choice(DOCS)))
        else:
            question = rng.choice(corpus.questions)
            items.append(Item(kind, question.text, (corpus.documents[question.document].text,)))
    return items


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
    residency = dataclasses.replace(residency, preload=mode.startswith("lru-markov"))
    if mode == "lru-markov-next":
        residency = dataclasses.replace(residency, preload_steps=1)
    return dataclasses.replace(config, residency=residency)


async def run_mode(config, mode: str, items: list[Item], max_tokens: int, rag_config: dict) -> dict:
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
        latencies: dict[str, list[float]] = {kind: [] for kind in sorted({item.kind for item in items})}
        start = time.perf_counter()
        for item in items:
            t0 = time.perf_counter()
            if item.kind in ("rag", "rag2"):
                llm = rag_llm if item.kind == "rag" else chat_llm
                run = await service.run("naive_rag", {"question": item.text, "documents": list(item.documents)},
                                        {**rag_config, "max_tokens": max_tokens, "engines": {"llm": llm}})
                if run.status != "succeeded":
                    raise RuntimeError(f"{mode}: naive_rag {run.status}: {run.error}")
            elif item.kind == "chat":
                engine = pool.resolve(chat_llm).engine
                tokens = engine.chat_tokens([{"role": "user", "content": item.text}])
                params = SamplingParams(max_tokens=max_tokens, temperature=0)
                async for _ in service.generate(chat_llm, tokens, params):
                    pass
            else:
                await pool.resolve(embedder).batch().submit(EmbedRequest((item.text,)), 1)
            latencies[item.kind].append(time.perf_counter() - t0)
            if mode == "load-per-request":
                await pool.residency.unload_idle()
        wall = time.perf_counter() - start
        after = pool.metrics.render().decode()

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    predictions = delta("headrace_markov_predictions_total")
    return {
        "llms": {"rag": rag_llm, "chat" if "chat" in latencies else "rag2": chat_llm},
        "budget_bytes": config.residency.budget_bytes,
        "preload_steps": config.residency.preload_steps if config.residency.preload else None,
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
        "peak_resident_bytes": pool.residency.peak_resident_bytes,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "residency.toml")
    parser.add_argument("--workload", choices=("chat", "documents"), default="chat")
    parser.add_argument("--doc-tokens", type=int, default=4000, help="documents: each run's document (tokens, about)")
    parser.add_argument("--top-k", type=int, default=None, help="the chunks each rag answer reads")
    parser.add_argument("--chunk-size", type=int, default=None, help="words per chunk of a rag run's documents")
    parser.add_argument("--no-passes", action="store_true",
                        help="rag runs without the optimization passes (the prefill split's early prefill calls "
                             "the LLM at a run's start, so its load starts there even on demand)")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--budget-bytes", type=int, default=None, help="instead of the config's [residency] budget")
    parser.add_argument("--modes", nargs="+", choices=MODES + EXTRA_MODES, default=list(MODES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--data-dir", type=Path, default=None, help="the runs' LanceDB directory (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "residency.json")
    args = parser.parse_args()
    if args.tiny:
        args.requests, args.max_tokens, args.doc_tokens = 6, 4, min(args.doc_tokens, 400)
    rag_config = {key: value for key, value in [("top_k", args.top_k), ("chunk_size", args.chunk_size)]
                  if value is not None}
    if args.no_passes:
        rag_config["optimize"] = {"passes": []}

    import tempfile

    from headrace.daemon.config import load_config

    with tempfile.TemporaryDirectory() as tmp:
        data = str(args.data_dir or tmp)
        config = load_config(args.config, env={}, overrides={"data.dir": data})
        items = stream(args.requests, args.seed, args.workload, args.doc_tokens)
        results = {"config": str(args.config), "workload": args.workload, "requests": args.requests,
                   "max_tokens": args.max_tokens, "rag_config": rag_config, "tiny": args.tiny,
                   "doc_tokens": args.doc_tokens if args.workload == "documents" else None,
                   "stream": [item.kind for item in items], "modes": {}}
        for mode in args.modes:
            print(f"mode {mode} ...", file=sys.stderr, flush=True)
            results["modes"][mode] = anyio.run(run_mode, mode_config(config, mode, args.budget_bytes), mode, items,
                                               args.max_tokens, rag_config)
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
