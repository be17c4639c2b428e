#!/usr/bin/env python3
"""Engine benchmarks: LLM decode (direct vs HTTP), KV prefix reuse, embedding batching,
and the LLM engines against each other.

Prints a table with targets and writes bench-results/engines.json. Every ratio
is measured within one run. Each engine is shut down before the next one
starts, so no two share the cores: first the LLM engines named by --llm, in
turn (direct calls: decode at each concurrency, 16 full prefills, a fork), then
the embedder, then the HTTP server of configs/default.toml.

    python scripts/bench/engines.py [--quick | --tiny] [--llm torch llama-cpp vllm] [--skip-http] [--out FILE]

Each LLM runs SmolLM2-135M as the first file in configs/ that serves `smollm2` on
that plugin configures it (configs/default.toml first). `vllm` runs in
.venv-vllm (scripts/setup-vllm builds it), in a child process of this script.

--tiny runs every part with minimal sizes (the time is mostly loading models and
starting the server); the test suite runs it so the script cannot rot. Its
figures mean nothing.
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models ship in packages; never reach for a hub

import anyio
import httpx
from anyio.from_thread import start_blocking_portal

from benchlib import CPUWatch, cpu_note, median, write_results  # beside this script
from headrace.plugins.engines.st_embed import SentenceTransformerEmbedder
from headrace.plugins.manager import collect
from headrace.plugins.protocols import EngineEnv, EngineSpec, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "default.toml"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
LLM_PLUGINS = ("torch", "llama-cpp", "vllm")
OUT = ROOT / "bench-results" / "engines.json"
CACHE = Path.home() / ".cache" / "headrace"  # the server's default: both share the converted model

# Open-ended prompts, so answers run to max_tokens rather than stopping early at EOS.
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


def engine_spec(name: str) -> EngineSpec:
    """The named [[engines]] entry of configs/default.toml, as the daemon would build it."""
    e = next(e for e in tomllib.loads(CONFIG.read_text())["engines"] if e["name"] == name)
    return EngineSpec(name=e["name"], plugin=e["plugin"], model=e.get("model", ""), options=e.get("options", {}))


def llm_spec(plugin: str) -> tuple[EngineSpec, Path]:
    """`smollm2` on ``plugin``, as the first config serving it so configures it (default.toml first)."""
    for path in [CONFIG, *sorted((ROOT / "configs").glob("*.toml"))]:
        for e in tomllib.loads(path.read_text()).get("engines", []):
            if e["name"] == "smollm2" and e["plugin"] == plugin:
                return EngineSpec(name="smollm2", plugin=plugin, model=e.get("model", ""),
                                  options=e.get("options", {})), path
    raise SystemExit(f"no file in configs/ serves smollm2 on the {plugin!r} plugin")


def engine_env(tmp: Path, batches: list | None = None) -> EngineEnv:
    def observe(op: str, size: int, start: float, end: float) -> None:  # the engine's BatchObserver
        if batches is not None:
            batches.append((op, size))

    return EngineEnv(data_dir=tmp, cache_dir=CACHE, lookup=lambda name: None, observe_batch=observe)


def stdlib_sentences(n: int) -> list[str]:
    """Real, varied English sentences from the standard library's docstrings."""
    import collections, email, functools, itertools, pathlib, shutil, textwrap
    seen: dict[str, None] = {}
    for mod in (os, json, collections, functools, itertools, pathlib, shutil, subprocess, textwrap, email, re, inspect):
        for obj in [mod, *(v for _, v in inspect.getmembers(mod) if callable(v))]:
            for s in re.split(r"(?<=[.!?])\s+", " ".join((inspect.getdoc(obj) or "").split())):
                if 40 <= len(s) <= 300 and not s.startswith((">>>", "...")):
                    seen.setdefault(s)
    if len(seen) < n:
        raise SystemExit(f"only {len(seen)} docstring sentences, need {n}")
    return list(seen)[:n]


# ----- LLM decode: one driver for both paths -----------------------------------------


async def timed_round(one, idx: list[int]) -> tuple[list, float]:
    """Run one request per prompt index concurrently; per request (tokens, first, last) from round start."""
    results: list = [None] * len(idx)
    t0 = perf_counter()

    async def run(k: int) -> None:
        n, first, last = await one(idx[k])
        results[k] = (n, first - t0, last - t0)

    async with anyio.create_task_group() as tg:
        for k in range(len(idx)):
            tg.start_soon(run, k)
    return results, perf_counter() - t0


async def measure(one, args) -> dict:
    # Warm-up: a full-width batched round, then a solo request, so no shape is first seen while timed.
    await timed_round(one, list(range(max(args.concurrency))))
    await one(0)
    out = {}
    for c in args.concurrency:
        tok_s, dec_s, ttft, tokens = [], [], [], 0
        for r in range(args.rounds):
            # Distinct prompts, the same ones for direct and HTTP.
            reqs, wall = await timed_round(one, [(r * c + i) % len(QUESTIONS) for i in range(c)])
            tokens += sum(n for n, _, _ in reqs)
            tok_s.append(sum(n for n, _, _ in reqs) / wall)
            # Decode-only: the sum of per-stream rates after each first token (the streams overlap).
            dec_s.append(sum((n - 1) / (last - first) for n, first, last in reqs if n > 1 and last > first))
            ttft += [first for _, first, _ in reqs]
        out[c] = {"tokens": tokens, "tok_s": median(tok_s), "decode_tok_s": median(dec_s),
                  "ttft_p50_s": median(ttft), "tok_s_rounds": tok_s}
    return out


def bench_llm(plugin: str, args, tmp: Path) -> dict:
    """One LLM engine's direct figures; vLLM's from a child process in .venv-vllm when not importable here."""
    if plugin in collect().engines:
        spec, config = llm_spec(plugin)
        decode, prefix = bench_direct(spec, args, tmp)
        res = {"config": str(config.relative_to(ROOT)), "options": spec.options, "decode": decode, "prefix": prefix}
        return json.loads(json.dumps(res))  # keys as a child's JSON has them (concurrency levels as strings)
    if plugin != "vllm" or not VLLM_PYTHON.exists():
        raise SystemExit(f"the {plugin!r} engine plugin is not installed" +
                         (" (scripts/setup-vllm builds .venv-vllm)" if plugin == "vllm" else ""))
    out = tmp / f"{plugin}.json"
    cmd = [str(VLLM_PYTHON), __file__, "--llm", plugin, "--only-llm", "--out", str(out), *args.size_flags]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return json.loads(out.read_text())["llm"][plugin]


def bench_direct(spec: EngineSpec, args, tmp: Path) -> tuple[dict, dict]:
    batches: list = []
    engine = collect().engines[spec.plugin](spec, engine_env(tmp, batches))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    with start_blocking_portal() as portal:
        future, _ = portal.start_task(engine.run)
        prompts = [engine.chat_tokens([{"role": "user", "content": q}]) for q in QUESTIONS]

        async def one(i: int):
            n, first, last = 0, None, None
            async for d in engine.generate(prompts[i], params):
                last = perf_counter()
                first = first or last
                n += len(d.token_ids)
            return n, first, last

        cpu = CPUWatch()
        decode = {"levels": portal.call(measure, one, args), "cpu_cores": cpu.cores()}
        cpu = CPUWatch()
        prefix = portal.call(bench_prefix, engine, args, batches)
        prefix["cpu_cores"] = cpu.cores()
        future.cancel()
    return decode, prefix


async def bench_prefix(engine, args, batches: list) -> dict:
    text = " ".join(inspect.getdoc(m) or "" for m in (os, json, re, subprocess, inspect, statistics))
    prefix = engine.encode(text)[: args.prefix_tokens]
    suffixes = [engine.encode(f"\nQuestion {i + 1}: {q}\nAnswer:")
                for i, q in enumerate(QUESTIONS[: args.prefix_contexts])]

    async def prefill_all(jobs) -> None:  # concurrent, so the engine batches them
        async with anyio.create_task_group() as tg:
            for job in jobs:
                tg.start_soon(engine.prefill, *job)

    async def free_all(ids) -> None:
        for ctx in ids:
            await engine.free(ctx)
        deadline = time.monotonic() + 10  # frees are queued commands: wait until the worker ran them
        while engine.stats()["contexts"] and time.monotonic() < deadline:
            await anyio.sleep(0.01)
        assert engine.stats()["contexts"] == 0, engine.stats()

    async def full() -> float:
        ids = [engine.new_context_id() for _ in suffixes]
        t0 = perf_counter()
        await prefill_all([(ctx, prefix + s) for ctx, s in zip(ids, suffixes)])
        elapsed = perf_counter() - t0
        await free_all(ids)
        return elapsed

    async def shared() -> tuple[float, float]:
        parent, ids = engine.new_context_id(), [engine.new_context_id() for _ in suffixes]
        t0 = perf_counter()
        await engine.prefill(parent, prefix)
        t1 = perf_counter()
        await prefill_all([(ctx, s, parent) for ctx, s in zip(ids, suffixes)])
        t2 = perf_counter()
        await free_all([*ids, parent])
        return t2 - t0, t2 - t1

    await full(), await shared()  # warm-up
    batches.clear()
    fulls, shareds = [], []
    for _ in range(args.prefix_reps):
        fulls.append(await full())
        shareds.append(await shared())
    f, s, ch = median(fulls), median(t for t, _ in shareds), median(c for _, c in shareds)
    return {"prefix_tokens": len(prefix), "suffix_tokens_avg": sum(map(len, suffixes)) / len(suffixes),
            "contexts": len(suffixes), "reps": args.prefix_reps, "full_s": f, "shared_s": s, "children_only_s": ch,
            "ratio": f / s, "ratio_children_only": f / ch,
            "prefill_tok_s": (len(suffixes) * len(prefix) + sum(map(len, suffixes))) / f,
            "prefill_batch_sizes": sorted({n for op, n in batches if op == "prefill"})}


def bench_http(args, tmp: Path) -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tmp / "server.log"
    cmd = [sys.executable, "-m", "headrace.daemon.cli", "serve", "--config", str(CONFIG), "--port", str(port),
           "--data-dir", str(tmp / "data")]
    # Drop HEADRACE_* overrides (an API key, say) so the server runs exactly configs/default.toml.
    server_env = {k: v for k, v in os.environ.items() if not k.startswith("HEADRACE_")}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=server_env, cwd=ROOT)
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
        cpu = CPUWatch([proc.pid])
        return {"levels": anyio.run(http_measure, args, base), "cpu_cores": cpu.cores()}
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
                        n = chunk["usage"]["completion_tokens"]  # exact; chunks with no text are not sent
                    choice = (chunk.get("choices") or [{}])[0]
                    # The first chunk carries only the role, sent before any token exists.
                    if choice.get("delta", {}).get("content") or choice.get("finish_reason"):
                        last = perf_counter()
                        first = first or last
            return n, first, last

        return await measure(one, args)


# ----- embeddings ------------------------------------------------------------------


def bench_embed(args, tmp: Path) -> dict:
    engine = SentenceTransformerEmbedder(engine_spec("all-minilm-l6-v2"), engine_env(tmp))
    sentences = stdlib_sentences(args.sentences)

    async def rate(batch: int) -> float:
        t0 = perf_counter()
        for i in range(0, len(sentences), batch):
            await engine.embed(sentences[i : i + batch])
        return len(sentences) / (perf_counter() - t0)

    with start_blocking_portal() as portal:
        future, _ = portal.start_task(engine.run)
        portal.call(rate, 32), portal.call(rate, 1)  # warm-up both shapes
        cpu = CPUWatch()
        b1, b32, one_call = (median([portal.call(rate, b) for _ in range(args.embed_reps)])
                             for b in (1, 32, len(sentences)))
        future.cancel()
    return {"sentences": len(sentences), "avg_chars": sum(map(len, sentences)) / len(sentences),
            "reps": args.embed_reps, "batch1_per_s": b1, "batch32_per_s": b32, "ratio": b32 / b1,
            "one_call_per_s": one_call, "cpu_cores": cpu.cores()}


# ----- report ----------------------------------------------------------------------------


def verdict(value: float, target: float, unit: str = "x") -> str:
    return f"target >= {target:g}{unit}  {'PASS' if value >= target else 'MISS'}"


def report(res: dict) -> None:
    http = res["http"]
    for plugin, llm in res["llm"].items():
        direct = llm["decode"]
        print(f"\n== LLM decode: smollm2 on {plugin} ({llm['config']}), greedy, max_tokens={res['max_tokens']}, "
              f"median of {res['rounds']} rounds ==")
        print(f"{'conc':>4}  {'path':<6} {'tokens':>7} {'tok/s':>8} {'decode tok/s':>13} {'TTFT p50':>9}")
        with_http = http is not None and plugin == res["http_plugin"]
        for c, d in direct["levels"].items():
            for name, m in [("direct", d)] + ([("http", http["levels"][c])] if with_http else []):
                print(f"{c:>4}  {name:<6} {m['tokens']:>7} {m['tok_s']:>8.1f} {m['decode_tok_s']:>13.1f} "
                      f"{m['ttft_p50_s'] * 1000:>7.0f}ms")
            if with_http:
                r = res["ratios"]["http_over_direct"][c]
                print(f"{'':>4}  http/direct tok/s = {r:.3f}   {verdict(r, 0.9, '')}")
        print(f"  direct: {cpu_note(direct)}")
        if with_http:
            cores = http["cpu_cores"]
            print(f"  http:   {cpu_note(http)}; server {cores['pids']:.2f} cores, client {cores['self']:.2f} cores")
        p = llm["prefix"]
        print(f"\n== Prefix reuse on {plugin}: {p['contexts']} suffixes of ~{p['suffix_tokens_avg']:.0f} tokens on "
              f"one {p['prefix_tokens']}-token prefix, median of {p['reps']} ==")
        print(f"  {p['contexts']} full prefills, concurrent  {p['full_s'] * 1000:8.1f} ms"
              f"   ({p['prefill_tok_s']:.0f} tok/s)")
        print(f"  parent + {p['contexts']} children        {p['shared_s'] * 1000:8.1f} ms"
              f"   (children alone {p['children_only_s'] * 1000:.1f} ms)")
        print(f"  speedup {p['ratio']:.2f}x   {verdict(p['ratio'], 5)}   (children alone: "
              f"{p['ratio_children_only']:.2f}x; prefill batch sizes seen {p['prefill_batch_sizes']})")
        print(f"  {cpu_note(p)}")
    if len(res["llm"]) > 1:
        compare(res)
    e = res.get("embed")
    if e is None:
        return
    print(f"\n== Embeddings: all-MiniLM-L6-v2, {e['sentences']} docstring sentences of ~{e['avg_chars']:.0f} chars, "
          f"median of {e['reps']} ==")
    print(f"  batch 1   {e['batch1_per_s']:8.1f} sentences/s")
    print(f"  batch 32  {e['batch32_per_s']:8.1f} sentences/s")
    print(f"  speedup {e['ratio']:.2f}x   {verdict(e['ratio'], 5)}")
    print(f"  (for reference: all {e['sentences']} in one embed call, length-sorted by sentence-transformers: "
          f"{e['one_call_per_s']:.1f} sentences/s)")
    print(f"  {cpu_note(e)}")


def compare(res: dict) -> None:
    """The LLM engines side by side, each ratio against the first engine measured."""
    llms = res["llm"]
    names = list(llms)
    rows = [(f"decode tok/s, concurrency {c}", lambda m, c=c: m["decode"]["levels"][c]["tok_s"])
            for c in llms[names[0]]["decode"]["levels"]]
    rows += [("prefill tok/s (concurrent full prefills)", lambda m: m["prefix"]["prefill_tok_s"]),
             ("fork speedup (parent + children vs full)", lambda m: m["prefix"]["ratio"])]
    print(f"\n== LLM engines side by side (ratio: against {names[0]}) ==")
    print(f"{'':<44}" + "".join(f"{n:>12}" for n in names) + "".join(f"{n + '/' + names[0]:>18}" for n in names[1:]))
    for label, figure in rows:
        values = [figure(llms[n]) for n in names]
        print(f"{label:<44}" + "".join(f"{v:>12.1f}" for v in values)
              + "".join(f"{v / values[0]:>17.2f}x" for v in values[1:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    size.add_argument("--tiny", action="store_true", help="minimal sizes: checks the script works, measures nothing")
    ap.add_argument("--llm", nargs="+", choices=LLM_PLUGINS, help="LLM engines to measure, one after the other "
                    "(default: the plugin of configs/default.toml's smollm2)")
    ap.add_argument("--only-llm", action="store_true", help="only the LLM engines: no embedder, no HTTP server")
    ap.add_argument("--skip-http", action="store_true", help="skip the /v1/chat/completions measurements")
    ap.add_argument("--out", type=Path, default=OUT, help=f"where the JSON goes (default {OUT.relative_to(ROOT)})")
    args = ap.parse_args()
    q = args.quick
    args.size_flags = ["--tiny"] if args.tiny else ["--quick"] if q else []
    default_plugin = engine_spec("smollm2").plugin
    args.llm = args.llm or [default_plugin]
    if args.tiny:
        args.concurrency, args.max_tokens, args.rounds = [1, 2], 4, 1
        args.prefix_tokens, args.prefix_contexts, args.prefix_reps = 32, 2, 1
        args.sentences, args.embed_reps = 4, 1
    else:
        args.concurrency = [1, 4] if q else [1, 4, 16]
        args.max_tokens, args.rounds = (16, 1) if q else (64, 5)
        args.prefix_tokens, args.prefix_contexts, args.prefix_reps = 400, len(QUESTIONS), (1 if q else 5)
        args.sentences, args.embed_reps = (64, 1) if q else (256, 3)

    t_start = perf_counter()
    with tempfile.TemporaryDirectory(prefix="headrace-bench-") as tmp_s:
        tmp = Path(tmp_s)
        llms = {plugin: bench_llm(plugin, args, tmp) for plugin in args.llm}  # each shut down on return
        embed = None if args.only_llm else bench_embed(args, tmp)
        # The server runs configs/default.toml: its LLM's direct figures are what it is compared with.
        skip_http = args.only_llm or args.skip_http or default_plugin not in llms
        http = None if skip_http else json.loads(json.dumps(bench_http(args, tmp)))  # string keys, as the LLMs
    res = {"quick": q, "tiny": args.tiny, "max_tokens": args.max_tokens, "rounds": args.rounds, "llm": llms,
           "http": http, "http_plugin": default_plugin, "embed": embed,
           "ratios": {"prefix_reuse": {p: m["prefix"]["ratio"] for p, m in llms.items()}}}
    if embed:
        res["ratios"]["embed_batch32_over_batch1"] = embed["ratio"]
    if http and default_plugin in llms:
        res["ratios"]["http_over_direct"] = {
            c: http["levels"][c]["tok_s"] / d["tok_s"] for c, d in llms[default_plugin]["decode"]["levels"].items()}
    write_results(res, args.out, t_start)
    report(res)
    print(f"\nwrote {args.out} ({res['meta']['elapsed_s']:.0f}s)")


if __name__ == "__main__":
    main()
