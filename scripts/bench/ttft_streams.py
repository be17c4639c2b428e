#!/usr/bin/env python3
"""Does a long prompt's time to first token depend on the llama-cpp engine's KV layout? (issue 51: headrace's
1,001-token TTFT trails llama-server's on the same kernels while its Python is ~2% of the time.)

    python scripts/bench/ttft_streams.py [--calls 12] [--out bench-results/ttft-streams.json]

The engine in this process, no HTTP, once per arm, all loaded at once and used in turn (the order reversed every
other call, so a drifting VM weighs on every arm alike): ``engine.generate`` of ``peers.py``'s 1,001-token TTFT
prompts (a new one each call, so no cache serves any of it; a warm-up call first), ``max_tokens`` 1, the time to
the first token. Arms, by the KV streams llama.cpp makes (a stream per sequence, ``kv_unified`` false):

- ``default``: ``configs/llama-cpp.toml``'s LLM options (32 contexts + 16 scoring + 32 cached prefixes = 80);
- ``no-cache``: the same without the prefix cache (48);
- ``server-like``: one context and no prefix cache (17: llama-server ``-np 16`` makes 16);
- ``direct``: no engine at all: the same llama.cpp library and weights, a context made as ``peers.py`` starts
  llama-server (16 sequences of ``max_context_tokens``, a stream each, the same batch and threads), the prompt
  decoded into sequence 0 a batch at a time with the last token's logits, then removed: the floor for this
  library, so what stands between it and ``server-like`` is the engine's.

Prints each arm's median and its median ratio to ``default`` over the paired calls (below 1: faster).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
from pathlib import Path
from time import perf_counter

from anyio.from_thread import start_blocking_portal

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import write_results  # noqa: E402 (beside this script)
from peers import CACHE, ROOT, llm_entry, workload  # noqa: E402

from headrace.plugins.engines.llama_cpp.engine import LlamaCppLLM  # noqa: E402
from headrace.plugins.engines.llama_cpp.files import llama  # noqa: E402
from headrace.plugins.engines.llama_cpp.kv_blend import decode_side_by_side  # noqa: E402
from headrace.plugins.protocols import EngineEnv, EngineSpec, SamplingParams  # noqa: E402

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0)


def arms(options: dict) -> dict[str, dict]:
    uncached = {**options, "prefix_cache_tokens": 0, "prefix_cache_sequences": 0, "prefix_cache_pin_tokens": 0}
    return {"default": options, "no-cache": uncached, "server-like": {**uncached, "n_seq_max": 1}}


class Direct:
    """llama.cpp with no engine: a context as peers.py starts llama-server (-np 16 -c 16 x per-slot, -b = -ub)."""

    SLOTS = 16

    def __init__(self, model_file: str, options: dict) -> None:
        lc = llama()
        mparams = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(model_file.encode(), mparams)
        params = lc.llama_context_default_params()
        self.n_batch = int(options.get("max_batch_tokens", 512))
        params.n_ctx = self.SLOTS * int(options.get("max_context_tokens", 2048))
        params.n_seq_max, params.kv_unified = self.SLOTS, False
        params.n_batch = params.n_ubatch = self.n_batch
        params.n_threads = params.n_threads_batch = int(options["threads"])
        params.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.model or not self.ctx:
            raise RuntimeError(f"llama.cpp could not load {model_file}")
        self.batch = lc.llama_batch_init(self.n_batch, 0, 1)

    def ttft(self, tokens: list[int]) -> float:
        lc = llama()
        start = perf_counter()
        decode_side_by_side(self.ctx, self.batch, [(0, tokens, 0)], self.n_batch, logits_of=0)
        lc.llama_get_logits_ith(self.ctx, -1)
        took = perf_counter() - start
        lc.llama_memory_seq_rm(lc.llama_get_memory(self.ctx), 0, -1, -1)
        return took

    def close(self) -> None:
        lc = llama()
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)


async def ttft(engine, tokens: list[int]) -> float:
    start = perf_counter()
    async for delta in engine.generate(tokens, FIRST_TOKEN):
        if delta.token_ids:
            return perf_counter() - start
    raise RuntimeError("the engine answered no token")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=12, help="timed calls an arm")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "ttft-streams.json")
    args = ap.parse_args()
    t_start = perf_counter()
    entry = llm_entry(ROOT / "configs" / "llama-cpp.toml")
    work = workload(argparse.Namespace(ttft_reps=args.calls, long_tokens=1000, prefill_streams=1, rounds=0,
                                       prefill_tokens=32))
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="headrace-ttft-streams-") as tmp, contextlib.ExitStack() as stack:
        engines = {}
        for name, options in arms(dict(entry.get("options", {}))).items():
            env = EngineEnv(data_dir=Path(tmp) / name, cache_dir=CACHE, lookup=lambda _: None)
            engine = LlamaCppLLM(EngineSpec(name=entry["name"], plugin="llama-cpp", model=entry["model"],
                                            options=options), env)
            portal = stack.enter_context(start_blocking_portal())
            stack.callback(portal.start_task(engine.run)[0].cancel)
            engines[name] = (engine, portal)
        first = next(iter(engines.values()))[0]
        direct = Direct(str(first.core.model_file), dict(entry.get("options", {})) | {"threads": first.core._threads})
        stack.callback(direct.close)
        tokenizer = first.tokenizer
        prompts = [tokenizer.encode(p, add_special_tokens=False) for p in work.long]

        def timed(name: str, tokens: list[int]) -> float:
            if name == "direct":
                return direct.ttft(tokens)
            engine, portal = engines[name]
            return portal.call(ttft, engine, tokens)

        names = [*engines, "direct"]
        for name in names:
            timed(name, prompts[0])  # warm: the first prefill of a context pays its setup
        times = {name: [] for name in names}
        for k in range(1, args.calls + 1):
            for name in (names if k % 2 else names[::-1]):
                times[name].append(timed(name, prompts[k]))
    base = times["default"]
    res = {"prompt_tokens": len(prompts[1]), "calls": args.calls, "arms": {
        name: {"ttft_s": ts, "median_s": statistics.median(ts),
               "median_ratio_to_default": statistics.median(t / b for t, b in zip(ts, base))}
        for name, ts in times.items()}}
    write_results(res, args.out, t_start)
    print(f"{res['prompt_tokens']}-token prompts, {args.calls} calls an arm")
    for name, arm in res["arms"].items():
        print(f"{name:>12}: TTFT median {arm['median_s'] * 1000:,.0f} ms, {arm['median_ratio_to_default']:.3f}x of default")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
