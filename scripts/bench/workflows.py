#!/usr/bin/env python3
"""Workflow benchmarks: advanced_rag and naive_rag, every optimization switched on and off.

One process, one set of engines (configs/default.toml), one run: each mode is a
workflow config, so the figures are ratios measured side by side.

    all       every pass, topology-aware batching
    none      no pass, FIFO batching: the sequential module chain (the baseline)
    -<pass>   every pass but that one, topology-aware batching

Each workflow runs every mode once to warm up, then ``--reps`` repetitions with
the modes interleaved round-robin (the order rotating each repetition), so
machine drift hits every mode alike. Every repetition asks one question of a
fixed corpus built from standard-library docstrings; all modes get the same
question. Greedy decoding can give different-length answers in different modes
(the prefill split tokenizes prompts differently), so the generated tokens of
each run are counted and reported next to its latency.

Prints tables and writes bench-results/workflows.json.

    python scripts/bench/workflows.py [--quick] [--reps N] [--seed S]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import random
import tempfile
from pathlib import Path
from time import perf_counter

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models ship in packages; never reach for a hub

from anyio.from_thread import start_blocking_portal

from benchlib import CPUWatch, cpu_note, mean, median, write_results  # beside this script
from headrace.daemon.config import load_config
from headrace.daemon.local import engines
from headrace.daemon.pool import EnginePool
from headrace.graph.service import WorkflowService, timeline

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "default.toml"
OUT = ROOT / "bench-results" / "workflows.json"
WORKFLOWS = ("advanced_rag", "naive_rag")
LLM = "smollm2"  # the LLM engine of configs/default.toml: its generated-token counter is read per run

# The corpus: module docstrings (~1,750 words in all, 10 chunks of <= 256 words), and questions about them.
MODULES = ("json", "csv", "heapq", "statistics", "copy", "subprocess")
QUESTIONS = [
    "How do I decode a JSON document into Python objects?",
    "How do I write a Python dictionary out as JSON text?",
    "How does the csv module read rows from a spreadsheet file?",
    "What is the difference between a shallow copy and a deep copy?",
    "How does a heap keep the smallest item at the front of a list?",
    "How do I compute the median and standard deviation of some data?",
    "How do I run a program and connect to its input and output pipes?",
    "How do I turn a list into a heap and pop its items in order?",
]


def corpus(seed: int) -> tuple[list[str], list[str], str]:
    """(documents, measured questions, warm-up question), in an order fixed by ``seed``."""
    rng = random.Random(seed)
    docs = [" ".join((inspect.getdoc(importlib.import_module(m)) or "").split()) for m in MODULES]
    rng.shuffle(docs)
    questions = list(QUESTIONS)
    rng.shuffle(questions)
    return docs, questions[:-1], questions[-1]


def modes(passes: list[str], quick: bool) -> dict[str, dict]:
    """Mode name -> the config keys it adds to every run."""
    out = {"all": {"batch_policy": "topology"},
           "none": {"optimize": {"passes": []}, "batch_policy": "fifo"}}
    if not quick:
        for p in passes:
            out[f"-{p}"] = {"optimize": {"passes": [q for q in passes if q != p]}, "batch_policy": "topology"}
    return out


OP_GROUPS = {"prefill": ("prefill", "partial_prefill", "full_prefill"), "decode": ("decode", "partial_decode"),
             "rerank": ("rerank",), "embed": ("embed",), "retrieval": ("ingest", "search", "text_search")}


def op_seconds(run) -> dict[str, float]:
    """Seconds the run's nodes spent running, summed per op class."""
    out = dict.fromkeys(OP_GROUPS, 0.0)
    for r in run.records:
        if r.started is not None and r.finished is not None:
            group = next((g for g, ops in OP_GROUPS.items() if r.op in ops), None)
            if group:
                out[group] += r.finished - r.started
    return out


# ----- engines and runs --------------------------------------------------------------


def generated_tokens(pool: EnginePool) -> float:
    value = pool.metrics.registry.get_sample_value("headrace_generation_tokens_total", {"model": LLM})
    return value or 0.0


def one_run(portal, svc: WorkflowService, pool: EnginePool, workflow: str, question: str, docs: list[str],
            config: dict) -> tuple[dict, object]:
    """One query, timed from submission (validation and optimization included) to its result."""
    tokens0, cpu = generated_tokens(pool), CPUWatch()
    t0 = perf_counter()
    run = portal.call(svc.run, workflow, {"question": question, "documents": list(docs)}, json.loads(json.dumps(config)))
    latency = perf_counter() - t0
    if run.status != "succeeded":
        raise SystemExit(f"{workflow} failed with config {config}: {run.error}")
    tokens = generated_tokens(pool) - tokens0
    decodes = sum(1 for r in run.records if r.op in ("decode", "partial_decode"))
    return {"latency_s": latency, "executor_s": run.finished - run.started, "gen_tokens": int(tokens),
            "decodes": decodes, "ms_per_token": 1000 * latency / tokens if tokens else None,
            "applied": sorted({name for name, _ in run.applied}), "op_seconds": op_seconds(run),
            "cpu_other": cpu.cores()["other_processes"],
            "answer": str(run.result.get("answer", ""))[:300]}, run


def bench_workflow(portal, svc, pool, workflow: str, mode_cfgs: dict[str, dict], base: dict, args,
                   docs: list[str], questions: list[str], warm_question: str) -> dict:
    stats = svc.optimizer.stats
    hits0, misses0 = stats.hits, stats.misses
    for name, extra in mode_cfgs.items():  # warm-up: every mode once, so no shape is first seen while timed
        one_run(portal, svc, pool, workflow, warm_question, docs, {**base, **extra})
    names = list(mode_cfgs)
    runs: list[dict] = []
    timelines: dict[str, list] = {}
    cpu = CPUWatch()
    for rep in range(args.reps):
        question = questions[rep % len(questions)]
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:  # round-robin, rotated so no mode always runs first
            rec, run = one_run(portal, svc, pool, workflow, question, docs, {**base, **mode_cfgs[name]})
            runs.append({"mode": name, "rep": rep, "question": question, **rec})
            if rep == 0 and name in ("all", "none"):
                timelines[name] = timeline(run)
    cores = cpu.cores()
    out_modes = summarize(runs, names)
    return {"config": base, "modes": out_modes, "runs": runs, "timelines": timelines, "cpu_cores": cores,
            "egraph_cache": {"hits": stats.hits - hits0, "misses": stats.misses - misses0,
                             "hit_rate": (stats.hits - hits0) / max(1, stats.hits - hits0 + stats.misses - misses0)}}


def summarize(runs: list[dict], names: list[str]) -> dict:
    by = {n: [r for r in runs if r["mode"] == n] for n in names}
    lat = {n: [r["latency_s"] for r in rs] for n, rs in by.items()}
    base_tok = mean([r["gen_tokens"] for r in by["none"]])
    out = {}
    for n, rs in by.items():
        tok = mean([r["gen_tokens"] for r in rs])
        # Paired by repetition (same question, same stretch of time): robust to drift between repetitions.
        paired = [a["latency_s"] / b["latency_s"] for a, b in zip(by["none"], rs)]
        paired_all = [b["latency_s"] / a["latency_s"] for a, b in zip(by["all"], rs)]
        out[n] = {
            "reps": len(rs), "mean_s": mean(lat[n]), "median_s": median(lat[n]), "latencies_s": lat[n],
            "gen_tokens_mean": tok, "gen_tokens": [r["gen_tokens"] for r in rs],
            "ms_per_token_mean": mean([r["ms_per_token"] for r in rs if r["ms_per_token"]]),
            "tokens_vs_none": tok / base_tok - 1 if base_tok else None,
            "tokens_differ": bool(base_tok) and abs(tok / base_tok - 1) > 0.2,
            "none_over_mode": mean(lat["none"]) / mean(lat[n]),
            "none_over_mode_paired_median": median(paired),
            "mode_over_all": mean(lat[n]) / mean(lat["all"]),
            "mode_over_all_paired_median": median(paired_all),
            "applied": sorted({p for r in rs for p in r["applied"]}),
            "op_seconds": {g: mean([r["op_seconds"][g] for r in rs]) for g in OP_GROUPS},
        }
    return out


# ----- report ----------------------------------------------------------------------------


def short(p: str) -> str:
    return p.split("_")[0]  # prune, stage, prefill, decode


def print_timeline(rows: list[dict], width: int = 44) -> None:
    rows = sorted((r for r in rows if r["start"] is not None), key=lambda r: (r["start"], r["node"]))
    total = max(r["end"] for r in rows) or 1.0
    print(f"  {'node':<26} {'key':<5} {'op':<15} {'start':>6} {'end':>6}  0{'':{width - 6}}{total:5.2f}s")
    for r in rows:
        a, b = round(r["start"] / total * width), round(r["end"] / total * width)
        bar = " " * a + ("#" * max(1, b - a) if b > a else "|")
        key = ",".join(map(str, r["key"])) or "-"
        print(f"  {r['node']:<26} {key:<5} {r['op']:<15} {r['start']:6.2f} {r['end']:6.2f}  {bar:<{width}}")


def report(res: dict) -> None:
    for wf, w in res["workflows"].items():
        cfg = ", ".join(f"{k}={v}" for k, v in w["config"].items())
        print(f"\n== {wf} ({cfg}): {res['reps']} reps after 1 warm-up per mode, modes interleaved ==")
        print(f"{'mode':<22} {'mean s':>7} {'median s':>8} {'gen tok':>7} {'ms/tok':>7} {'none/mode':>9} "
              f"{'paired':>6} {'mode/all':>8}  passes that changed the graph")
        for name, m in w["modes"].items():
            flag = f"  ** tokens {m['tokens_vs_none']:+.0%} vs none **" if m["tokens_differ"] else ""
            print(f"{name:<22} {m['mean_s']:7.2f} {m['median_s']:8.2f} {m['gen_tokens_mean']:7.1f} "
                  f"{m['ms_per_token_mean']:7.1f} {m['none_over_mode']:8.2f}x {m['none_over_mode_paired_median']:5.2f}x "
                  f"{m['mode_over_all']:7.2f}x  {','.join(map(short, m['applied'])) or '-'}{flag}")
        c = w["egraph_cache"]
        print(f"  none/all = {w['modes']['all']['none_over_mode']:.2f}x (mean latency), "
              f"{w['modes']['all']['none_over_mode_paired_median']:.2f}x (median of per-rep ratios)")
        print("  node-seconds by op class, mean per run (nodes overlap, so a row can exceed the latency):")
        print(f"  {'mode':<22} " + " ".join(f"{g:>8}" for g in OP_GROUPS) + f" {'latency':>8}")
        for name, m in w["modes"].items():
            print(f"  {name:<22} " + " ".join(f"{m['op_seconds'][g]:8.2f}" for g in OP_GROUPS) + f" {m['mean_s']:8.2f}")
        print(f"  e-graph cache: {c['hits']} hits, {c['misses']} misses, hit rate {c['hit_rate']:.0%} "
              f"(one miss per mode: the warm-up)")
        print(f"  {cpu_note(w)}; max on one run {max(r['cpu_other'] for r in w['runs']):.2f}")
    adv = res["workflows"].get("advanced_rag")
    if adv:
        for name in ("all", "none"):
            if name in adv["timelines"]:
                print(f"\n== advanced_rag timeline, mode {name}, repetition 0 (seconds from run start) ==")
                print_timeline(adv["timelines"][name])
    s = res["optimizer"]
    print(f"\ne-graph cache, whole run: {s['hits']} hits, {s['misses']} misses, hit rate {s['hit_rate']:.0%}, "
          f"{s['build_seconds'] * 1000:.0f} ms building graphs in all")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 rep, modes all and none only: a smoke run")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per mode (default 3)")
    ap.add_argument("--seed", type=int, default=0, help="orders the documents and questions (default 0)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per LLM answer (default 32)")
    ap.add_argument("--max-efficient-batch", type=int, default=None,
                    help="override [batching] max_efficient_batch_size (default: configs/default.toml's, 0 = "
                         "unknown, so stage_decomposition splits nothing)")
    ap.add_argument("--workflows", nargs="+", default=list(WORKFLOWS), choices=WORKFLOWS)
    args = ap.parse_args()
    if args.quick:
        args.reps = 1

    t_start = perf_counter()
    docs, questions, warm = corpus(args.seed)
    configs = {"advanced_rag": {"max_tokens": args.max_tokens, "n_queries": 3},
               "naive_rag": {"max_tokens": args.max_tokens}}
    res: dict = {"quick": args.quick, "reps": args.reps, "seed": args.seed,
                 "corpus": {"modules": list(MODULES), "words": sum(len(d.split()) for d in docs),
                            "questions": questions, "warm_up_question": warm},
                 "workflows": {}}
    with tempfile.TemporaryDirectory(prefix="headrace-bench-") as tmp, start_blocking_portal() as portal:
        overrides = {"data.dir": tmp, "batching.max_efficient_batch_size": args.max_efficient_batch}
        config = load_config(CONFIG, env={}, overrides=overrides)
        with portal.wrap_async_context_manager(engines(config)) as (pool, svc):
            passes = list(svc.optimizer.passes)
            mode_cfgs = modes(passes, args.quick)
            res["modes"] = mode_cfgs
            res["max_efficient_batch"] = {n: pool.max_efficient_batch(n) for n in pool.slots}
            print(f"engines ready in {perf_counter() - t_start:.0f}s; corpus {res['corpus']['words']} words from "
                  f"{len(docs)} docstrings; modes {', '.join(mode_cfgs)}", flush=True)
            for wf in args.workflows:
                t0 = perf_counter()
                res["workflows"][wf] = bench_workflow(portal, svc, pool, wf, mode_cfgs, configs[wf], args,
                                                      docs, questions, warm)
                print(f"  {wf}: {perf_counter() - t0:.0f}s", flush=True)
            s = svc.optimizer.stats
            res["optimizer"] = {"hits": s.hits, "misses": s.misses, "hit_rate": s.hit_rate, "build_seconds": s.build_seconds}
    write_results(res, OUT, t_start)
    report(res)
    print(f"\nwrote {OUT.relative_to(ROOT)} ({res['meta']['elapsed_s']:.0f}s)")


if __name__ == "__main__":
    main()
