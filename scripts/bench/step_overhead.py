#!/usr/bin/env python3
"""How long does the llama-cpp engine spend outside ``llama_decode`` for each decoded token? (issue 51: one
stream trails llama-server on the same kernels.)

    python scripts/bench/step_overhead.py [--requests 10] [--tokens 128] [--streams 1] [--out FILE]

The engine of ``configs/llama-cpp.toml`` in this process, no HTTP: ``--streams`` greedy requests at once,
``--tokens`` tokens each (``ignore_eos``), ``--requests`` rounds after an untimed one, each round's prompts new.
Every ``llama_decode`` call is timed; a round's wall time from its first token to its last, less the time inside
``llama_decode``, over its decode steps, is what the engine's Python (scheduling, sampling, detokenizing, the
hand-off to the event loop) and any wait for the GIL added to each step. The same figure for ``direct``, a bare
loop over the same library and weights (the batch filled, ``llama_decode``, the argmax of the logits; one stream
only), is the floor. Deterministic enough to compare two versions of the engine, which a tok/s ratio on a
shared VM is not (its starts spread 10-20%).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import statistics
import sys
import tempfile
from pathlib import Path
from time import perf_counter

import anyio
import numpy as np
from anyio.from_thread import start_blocking_portal

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import write_results  # noqa: E402 (beside this script)
from peers import CACHE, ROOT, llm_entry  # noqa: E402
from ttft_streams import Direct  # noqa: E402

from headrace.plugins.engines.llama_cpp.engine import LlamaCppLLM  # noqa: E402
from headrace.plugins.engines.llama_cpp.files import llama  # noqa: E402
from headrace.plugins.engines.llama_cpp.kv_blend import decode_side_by_side  # noqa: E402
from headrace.plugins.protocols import EngineEnv, EngineSpec, SamplingParams  # noqa: E402


class DecodeClock:
    """Time inside ``llama_decode`` (the bindings' function replaced by a timed call) and the calls made."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0
        self._lc = llama()
        self._real = self._lc.llama_decode

        def timed(ctx, batch):
            start = perf_counter()
            try:
                return self._real(ctx, batch)
            finally:
                self.seconds += perf_counter() - start
                self.calls += 1

        self._lc.llama_decode = timed

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def close(self) -> None:
        self._lc.llama_decode = self._real


def prompt(tokenizer, k: int) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": f"Request {k}: tell me a long story about "
                                                                       f"the number {k * 7}."}],
                                         tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


async def engine_round(engine, clock: DecodeClock, prompts: list[list[int]],
                       params: SamplingParams) -> tuple[float, int]:
    """µs outside llama_decode per decode step, from the round's first token to its last; the steps timed."""
    first: list[float] = []

    async def one(tokens: list[int]) -> None:
        async for delta in engine.generate(tokens, params):
            if delta.token_ids and not first:
                first.append(perf_counter())
                clock.reset()  # the steps from here on are decode steps (every prompt is in by the first token
                # of a one-stream round; with more streams, later prompts' prefill steps count too)

    async with anyio.create_task_group() as tg:
        for tokens in prompts:
            tg.start_soon(one, tokens)
    wall = perf_counter() - first[0]
    return (wall - clock.seconds) / max(clock.calls, 1) * 1e6, clock.calls


def last_logits(ctx, n_vocab: int) -> np.ndarray:
    """The last output row, viewed in place (no per-call ctypes type: that alone is tens of µs, see files.float_rows;
    written here so this script also measures engine versions from before it)."""
    lc = llama()
    return np.frombuffer(ctypes.cast(lc.llama_get_logits_ith(ctx, -1), ctypes.POINTER(ctypes.c_float * n_vocab))
                         .contents, dtype=np.float32)


def direct_round(direct: Direct, clock: DecodeClock, tokens: list[int], n: int, n_vocab: int) -> tuple[float, int]:
    lc = llama()
    decode_side_by_side(direct.ctx, direct.batch, [(0, tokens, 0)], direct.n_batch, logits_of=0)
    pos = len(tokens)
    token = int(last_logits(direct.ctx, n_vocab).argmax())
    start = perf_counter()
    clock.reset()
    for _ in range(n - 1):
        decode_side_by_side(direct.ctx, direct.batch, [(0, [token], pos)], direct.n_batch, logits_of=0)
        pos += 1
        token = int(last_logits(direct.ctx, n_vocab).argmax())
    wall = perf_counter() - start
    lc.llama_memory_seq_rm(lc.llama_get_memory(direct.ctx), 0, -1, -1)
    return (wall - clock.seconds) / max(clock.calls, 1) * 1e6, clock.calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10, help="timed rounds")
    ap.add_argument("--tokens", type=int, default=128, help="tokens a request")
    ap.add_argument("--streams", type=int, default=1, help="requests at once in a round")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "step-overhead.json")
    args = ap.parse_args()
    t_start = perf_counter()
    entry = llm_entry(ROOT / "configs" / "llama-cpp.toml")
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    clock = DecodeClock()
    engine_us, direct_us, engine_steps, direct_steps = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="headrace-step-overhead-") as tmp, contextlib.ExitStack() as stack:
        stack.callback(clock.close)
        env = EngineEnv(data_dir=Path(tmp), cache_dir=CACHE, lookup=lambda _: None)
        engine = LlamaCppLLM(EngineSpec(name=entry["name"], plugin="llama-cpp", model=entry["model"],
                                        options=dict(entry.get("options", {}))), env)
        portal = stack.enter_context(start_blocking_portal())
        stack.callback(portal.start_task(engine.run)[0].cancel)
        core = engine.core
        direct = Direct(str(core.model_file), dict(entry.get("options", {})) | {"threads": core._threads})
        stack.callback(direct.close)
        lc = llama()
        n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(direct.model))
        tokenizer = engine.tokenizer
        k = 0
        for r in range(args.requests + 1):  # the first round warms both up, untimed
            prompts = [prompt(tokenizer, k + i) for i in range(args.streams)]
            k += args.streams
            us, steps = portal.call(engine_round, engine, clock, prompts, params)
            if args.streams == 1:
                d, d_steps = direct_round(direct, clock, prompt(tokenizer, k), args.tokens, n_vocab)
                k += 1
                if r:
                    direct_us.append(d)
                    direct_steps.append(d_steps)
            if r:
                engine_us.append(us)
                engine_steps.append(steps)
    res = {"streams": args.streams, "tokens": args.tokens, "requests": args.requests,
           "engine_us_per_step": engine_us, "engine_median_us": statistics.median(engine_us),
           "engine_steps": engine_steps, "direct_steps": direct_steps, "direct_us_per_step": direct_us, "direct_median_us": statistics.median(direct_us) if direct_us else None}
    write_results(res, args.out, t_start)
    print(f"outside llama_decode a decode step, {args.streams} stream(s), {args.tokens} tokens, "
          f"{args.requests} rounds: engine median {res['engine_median_us']:.0f} us"
          + (f", direct loop {res['direct_median_us']:.0f} us" if direct_us else ""))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
