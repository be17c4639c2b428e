#!/usr/bin/env python3
"""Engine benchmarks: LLM decode (direct vs HTTP), KV prefix reuse, embedding batching.

Prints a table with targets and writes bench-results/engines.json. Each ratio is
measured within one run; the direct LLM figures come first, and the engine is
shut down before the HTTP server starts, so the two never share the 2 cores.

    python scripts/bench/engines.py [--quick] [--skip-http]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from time import perf_counter

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models ship in packages; never reach a hub

import anyio
import httpx
from anyio.from_thread import start_blocking_portal

from headrace.plugins.engines.st_embed import SentenceTransformerEmbedder
from headrace.plugins.engines.torch_llm import TorchLLM
from headrace.plugins.protocols import EngineEnv, EngineSpec, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "default.toml"
OUT = ROOT / "bench-results" / "engines.json"
CACHE = Path.home() / ".cache" / "headrace"  # the server's default: share the converted model

# Open-ended prompts, so most answers run to max_tokens rather than stopping at EOS.
QUESTIONS = [
    "Write a detailed essay about the history of bridges.", "Explain how a steam engine works, step by step.",
    "Describe a walk through a busy market in Marrakesh.", "Write a long story about a lighthouse keeper.",
    "Explain the water cycle to a ten year old in detail.", "Describe the life cycle of a star.",
    "Write a letter to a friend about your summer holiday.", "Explain how vaccines train the immune system.",
    "Describe how bread is made, from wheat field to bakery.", "Write a story about a robot learning to paint.",
    "Explain why the sky is blue and sunsets are red.", "Describe the rules and strategy of chess.",
    "Write a travel guide for a weekend in Rome.", "Explain how the internet routes a message.",
    "Describe the history of the printing press.", "Write a long poem about the sea in winter.",
]


def engine_entry(name: str) -> dict:
    engines = tomllib.loads(CONFIG.read_text())["engines"]
    return next(e for e in engines if e["name"] == name)


def env(tmp: Path, batches: list | None = None) -> EngineEnv:
    observe = (lambda op, n: batches.append((op, n))) if batches is not None else (lambda op, n: None)
    return EngineEnv(data_dir=tmp, cache_dir=CACHE, lookup=lambda name: None, observe_batch=observe)


def stdlib_sentences(n: int) -> list[str]:
    """Real, varied English sentences from the standard library's docstrings."""
    import collections, email, functools, itertools, json as j, os as o, pathlib, shutil, subprocess as sp, textwrap
    seen, out = set(), []
    for mod in (o, j, collections, functools, itertools, pathlib, shutil, sp, textwrap, email, re, inspect):
        for obj in [mod, *(v for _, v in inspect.getmembers(mod) if callable(v))]:
            doc = inspect.getdoc(obj) or ""
            for s in re.split(r"(?<=[.!?])\s+", " ".join(doc.split())):
                if 40 <= len(s) <= 300 and s not in seen and not s.startswith((">>>", "...")):
                    seen.add(s)
                    out.append(s)
    if len(out) < n:
        raise SystemExit(f"only {len(out)} docstring sentences, need {n}")
    return out[:n]


def median(xs):
    return statistics.median(xs) if xs else 0.0


def summarize(rounds: list[list[tuple[int, float, float]]], walls: list[float]) -> dict:
    """rounds: per request (tokens, first-token s, last-token s), times relative to the round start."""
    tok_s, dec_s, ttft = [], [], []
    for reqs, wall in zip(rounds, walls):
        tok_s.append(sum(n for n, _, _ in reqs) / wall)
        # Decode-only: sum of per-stream rates after each stream's first token (streams overlap).
        dec_s.append(sum((n - 1) / (last - first) for n, first, last in reqs if n > 1 and last > first))
        ttft += [first for _, first, _ in reqs]
    return {"tokens": sum(n for r in rounds for n, _, _ in r), "tok_s": median(tok_s),
            "decode_tok_s": median(dec_s), "ttft_p50_s": median(ttft), "wall_s": sum(walls), "rounds": len(rounds)}


def round_prompts(c: int, r: int) -> list[int]:
    """Which QUESTIONS round r at concurrency c uses: distinct, identical for direct and HTTP."""
    return [(r * c + i) % len(QUESTIONS) for i in range(c)]


async def timed_round(one, idx: list[int]) -> tuple[list, float]:
    results: list = [None] * len(idx)
    t0 = perf_counter()

    async def run(k: int) -> None:
        n, first, last = await one(idx[k])
        results[k] = (n, first - t0, last - t0)

    async with anyio.create_task_group() as tg:
        for k in range(len(idx)):
            tg.start_soon(run, k)
    return results, perf_counter() - t0


async def measure(one, concurrency, rounds, warmup) -> dict:
    await warmup()
    out = {}
    for c in concurrency:
        rs, walls = [], []
        for r in range(rounds):
            res, wall = await timed_round(one, round_prompts(c, r))
            rs.append(res)
            walls.append(wall)
        out[c] = summarize(rs, walls)
    return out


# ----- direct engine -----------------------------------------------------------


def bench_direct(args, tmp: Path) -> tuple[dict, dict]:
    entry = engine_entry("smollm2")
    batches: list = []
    spec = EngineSpec(name="smollm2", plugin="torch", model=entry["model"], options=entry.get("options", {}))
    engine = TorchLLM(spec, env(tmp, batches))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    with start_blocking_portal() as portal:
        future, _ = portal.start_task(engine.run)
        prompts = [engine.chat_tokens([{"role": "user", "content": q}]) for q in QUESTIONS]

        async def one(i: int):
            n, first, last = 0, None, None
            async for d in engine.generate(prompts[i], params):
                now = perf_counter()
                n += len(d.token_ids)
                first = first or now
                last = now
            return n, first, last

        async def warmup():  # a batched round exercises prefill and decode shapes before timing
            await timed_round(one, list(range(len(QUESTIONS))))

        decode = portal.call(measure, one, args.concurrency, args.rounds, warmup)
        prefix = portal.call(bench_prefix, engine, args, batches)
        future.cancel()
    return decode, prefix


async def wait_freed(engine) -> None:
    deadline = time.monotonic() + 10
    while engine.stats()["contexts"] and time.monotonic() < deadline:
        await anyio.sleep(0.01)
    assert engine.stats()["contexts"] == 0, engine.stats()


async def bench_prefix(engine, args, batches: list) -> dict:
    text = " ".join(inspect.getdoc(m) or "" for m in (os, json, re, subprocess, inspect, statistics))
    prefix = engine.encode(text)[: args.prefix_tokens]
    suffixes = [engine.encode(f"\nQuestion {i + 1}: {q}\nAnswer:") for i, q in enumerate(QUESTIONS)]

    async def full() -> float:
        ids = [engine.new_context_id() for _ in suffixes]
        t0 = perf_counter()
        async with anyio.create_task_group() as tg:
            for ctx, s in zip(ids, suffixes):
                tg.start_soon(engine.prefill, ctx, prefix + s)
        elapsed = perf_counter() - t0
        for ctx in ids:
            await engine.free(ctx)
        await wait_freed(engine)
        return elapsed

    async def shared() -> tuple[float, float]:
        parent, ids = engine.new_context_id(), [engine.new_context_id() for _ in suffixes]
        t0 = perf_counter()
        await engine.prefill(parent, prefix)
        t1 = perf_counter()
        async with anyio.create_task_group() as tg:
            for ctx, s in zip(ids, suffixes):
                tg.start_soon(engine.prefill, ctx, s, parent)
        t2 = perf_counter()
        for ctx in [*ids, parent]:
            await engine.free(ctx)
        await wait_freed(engine)
        return t2 - t0, t2 - t1

    await full(), await shared()  # warm-up
    fulls, shareds, childs = [], [], []
    batches.clear()
    for _ in range(args.prefix_reps):
        fulls.append(await full())
        total, children = await shared()
        shareds.append(total)
        childs.append(children)
    sizes = sorted({n for op, n in batches if op == "prefill"})
    f, s, ch = median(fulls), median(shareds), median(childs)
    return {"prefix_tokens": len(prefix), "suffix_tokens_avg": sum(map(len, suffixes)) / len(suffixes),
            "contexts": len(suffixes), "reps": args.prefix_reps, "full_s": f, "shared_s": s,
            "children_only_s": ch, "ratio": f / s, "ratio_children_only": f / ch, "prefill_batch_sizes": sizes}


# ----- HTTP ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_http(args, tmp: Path) -> dict:
    port = free_port()
    log = tmp / "server.log"
    cmd = [sys.executable, "-m", "headrace.daemon.cli", "serve", "--config", str(CONFIG), "--port", str(port),
           "--data-dir", str(tmp / "data")]
    # Drop HEADRACE_* overrides (an API key, say) so the server runs exactly configs/default.toml.
    senv = {k: v for k, v in os.environ.items() if not k.startswith("HEADRACE_")}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=senv, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not become ready:\n{log.read_text()}")
            try:
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        return anyio.run(http_measure, args, base)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


async def http_measure(args, base: str) -> dict:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as client:

        async def one(i: int):
            body = {"model": "smollm2", "messages": [{"role": "user", "content": QUESTIONS[i]}],
                    "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            n, first, last = 0, None, None
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        n = chunk["usage"]["completion_tokens"]  # exact, unlike counting chunks
                    ch = chunk.get("choices") or [{}]
                    # The first chunk only carries the role, before any token exists.
                    if ch[0].get("delta", {}).get("content") or ch[0].get("finish_reason"):
                        last = perf_counter()
                        first = first or last
            return n, first, last

        async def warmup():
            await timed_round(one, list(range(len(QUESTIONS))))

        return await measure(one, args.concurrency, args.rounds, warmup)


# ----- embeddings ------------------------------------------------------------------


def bench_embed(args, tmp: Path) -> dict:
    entry = engine_entry("all-minilm-l6-v2")
    spec = EngineSpec(name=entry["name"], plugin=entry["plugin"], model=entry["model"],
                      options=entry.get("options", {}))
    engine = SentenceTransformerEmbedder(spec, env(tmp))
    sentences = stdlib_sentences(args.sentences)

    async def run(batch: int) -> float:
        t0 = perf_counter()
        for i in range(0, len(sentences), batch):
            await engine.embed(sentences[i : i + batch])
        return len(sentences) / (perf_counter() - t0)

    with start_blocking_portal() as portal:
        future, _ = portal.start_task(engine.run)
        portal.call(run, 32), portal.call(run, 1)  # warm-up both shapes
        b1 = median([portal.call(run, 1) for _ in range(args.embed_reps)])
        b32 = median([portal.call(run, 32) for _ in range(args.embed_reps)])
        future.cancel()
    return {"sentences": len(sentences), "avg_chars": sum(map(len, sentences)) / len(sentences),
            "reps": args.embed_reps, "batch1_per_s": b1, "batch32_per_s": b32, "ratio": b32 / b1}


# ----- report ----------------------------------------------------------------------------


def verdict(value: float, target: float) -> str:
    return f"target >= {target:g}x  {'PASS' if value >= target else 'MISS'}"


def report(res: dict) -> None:
    print(f"\n== LLM decode (smollm2 bf16, threads=2, greedy, max_tokens={res['max_tokens']}, "
          f"median of {res['rounds']} rounds) ==")
    print(f"{'conc':>4}  {'path':<6} {'tokens':>7} {'tok/s':>8} {'decode tok/s':>13} {'TTFT p50':>9}")
    for c, d in res["direct"].items():
        rows = [("direct", d)] + ([("http", res["http"][c])] if res.get("http") else [])
        for name, m in rows:
            print(f"{c:>4}  {name:<6} {m['tokens']:>7} {m['tok_s']:>8.1f} {m['decode_tok_s']:>13.1f} "
                  f"{m['ttft_p50_s'] * 1000:>7.0f}ms")
        if res.get("http"):
            r = res["ratios"]["http_over_direct"][c]
            print(f"{'':>4}  http/direct = {r:.3f}   {verdict(r, 0.9).replace('x', '')}")
    p = res["prefix"]
    print(f"\n== Prefix reuse ({p['contexts']} suffixes of ~{p['suffix_tokens_avg']:.0f} tokens on a "
          f"{p['prefix_tokens']}-token prefix, median of {p['reps']}) ==")
    print(f"  full prefills (batched)       {p['full_s'] * 1000:8.1f} ms")
    print(f"  parent + {p['contexts']} children          {p['shared_s'] * 1000:8.1f} ms"
          f"  (children only {p['children_only_s'] * 1000:.1f} ms)")
    print(f"  speedup {p['ratio']:.2f}x  {verdict(p['ratio'], 5)}   (children only: {p['ratio_children_only']:.2f}x;"
          f" prefill batch sizes seen {p['prefill_batch_sizes']})")
    e = res["embed"]
    print(f"\n== Embeddings (all-MiniLM-L6-v2, {e['sentences']} docstring sentences, ~{e['avg_chars']:.0f} chars,"
          f" median of {e['reps']}) ==")
    print(f"  batch 1   {e['batch1_per_s']:8.1f} sentences/s")
    print(f"  batch 32  {e['batch32_per_s']:8.1f} sentences/s")
    print(f"  speedup {e['ratio']:.2f}x  {verdict(e['ratio'], 5)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    ap.add_argument("--skip-http", action="store_true", help="skip the /v1/chat/completions measurements")
    args = ap.parse_args()
    q = args.quick
    args.concurrency = [1, 4] if q else [1, 4, 16]
    args.max_tokens, args.rounds = (16, 1) if q else (64, 3)
    args.prefix_tokens, args.prefix_reps = 400, (1 if q else 5)
    args.sentences, args.embed_reps = (64, 1) if q else (256, 3)

    t_start = perf_counter()
    with tempfile.TemporaryDirectory(prefix="headrace-bench-") as tmp_s:
        tmp = Path(tmp_s)
        direct, prefix = bench_direct(args, tmp)  # engine is shut down on return
        embed = bench_embed(args, tmp)
        http = None if args.skip_http else bench_http(args, tmp)
    res = {"quick": q, "max_tokens": args.max_tokens, "rounds": args.rounds, "direct": direct, "http": http,
           "prefix": prefix, "embed": embed, "ratios": {}}
    if http:
        res["ratios"]["http_over_direct"] = {c: http[c]["tok_s"] / direct[c]["tok_s"] for c in direct}
    res["ratios"].update(prefix_reuse=prefix["ratio"], embed_batch32_over_batch1=embed["ratio"])
    res["meta"] = {"python": sys.version.split()[0], "cpus": os.cpu_count(), "elapsed_s": perf_counter() - t_start,
                   "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    report(res)
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(res, indent=2))
    print(f"\nwrote {OUT.relative_to(ROOT)} ({res['meta']['elapsed_s']:.0f}s)")


if __name__ == "__main__":
    main()
