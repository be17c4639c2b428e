#!/usr/bin/env python3
"""The cross-key cache probe (issue 50): can one API key tell from the time to first token whether another key
sent a prompt? The daemon as the default config serves its LLM (its engine alone), with two API keys kept apart
(``[server] share_cache_across_keys = false``, the default).

Each trial takes a long prompt no one has sent and times the first token of, in this order:

- ``cold``: key A sends it (nothing cached);
- then, in a random order, ``same key``: key A again (its prefix a hit); ``cross key``: key B, the probe;
  ``cross salt``: key A with a ``cache_salt`` no one used.

A side channel is ``cross key`` (or ``cross salt``) answering sooner than ``cold``. Mann-Whitney U tests each
against ``cold`` (two-sided; p > 0.05: no difference found) and ``same key`` against ``cold`` (the hit the probe
would see, were the caches shared). Each request is streamed with its usage: the first token's arrival is its
TTFT, ``cached_tokens`` says what the prefix cache served. With ``--shared`` the daemon shares the caches across
keys (``share_cache_across_keys = true``): the side channel as it was, for comparison.

    python scripts/bench/cache_isolation.py [--trials 30] [--words 60] [--shared] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from benchlib import ROOT, CPUWatch, cpu_note, write_results  # beside this script
from headrace.bench.client import DaemonProcess

KEY_A, KEY_B = "bench-key-a", "bench-key-b"
KINDS = ("cold", "same key", "cross key", "cross salt")


def config_file(directory: Path, shared: bool) -> Path:
    """The default config's LLM alone (the embedder, reranker and store would only take memory)."""
    text = (ROOT / "configs" / "default.toml").read_text()
    head, llm = text.split("\n[[engines]]")[:2]
    head = head.replace("share_cache_across_keys = false", f"share_cache_across_keys = {str(shared).lower()}")
    path = directory / "cache_isolation.toml"
    path.write_text(f"{head}\n[[engines]]{llm}")
    return path


def prompt(trial: int, words: int) -> list[dict]:
    """A system prompt of ``words`` sentences (~12 tokens each) no other trial shares past its first words."""
    tag = uuid.uuid4().hex[:8]
    text = " ".join(f"Log {tag}.{i}: sluice {i * 7 % 31} checked, level {i * 13 % 97} cm." for i in range(words))
    return [{"role": "system", "content": text}, {"role": "user", "content": f"Trial {trial}: what was checked?"}]


def ttft(http: httpx.Client, key: str, messages: list[dict], salt: str | None) -> tuple[float, int, int]:
    """(seconds to the first token, cached prompt tokens, prompt tokens) of one streamed chat."""
    body = {"model": "smollm2", "messages": messages, "max_tokens": 1, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **({"cache_salt": salt} if salt else {})}
    first, usage = None, None
    start = time.perf_counter()
    with http.stream("POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            # The role chunk comes before the prefill: the first token is the first chunk with content or an end.
            if first is None and any(c["delta"].get("content") or c.get("finish_reason") for c in chunk["choices"]):
                first = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    return first, usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]


def compare(a: list[float], b: list[float]) -> dict:
    """Mann-Whitney U of ``a`` against ``b``, two-sided; ``p_a_less``: how likely ``a`` is lower by chance alone
    (the side channel's direction); ``cles``: the chance a draw of ``a`` is below one of ``b``."""
    from scipy.stats import mannwhitneyu

    two = mannwhitneyu(a, b, alternative="two-sided")
    less = mannwhitneyu(a, b, alternative="less")
    return {"u": float(two.statistic), "p": float(two.pvalue), "p_a_less": float(less.pvalue),
            "cles": 1 - float(two.statistic) / (len(a) * len(b)),  # scipy's U counts the pairs where a is higher
            "median_ratio": statistics.median(a) / statistics.median(b)}


def quantiles(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=10)
    return {"median_ms": statistics.median(xs) * 1000, "p10_ms": q[0] * 1000, "p90_ms": q[-1] * 1000,
            "mean_ms": statistics.fmean(xs) * 1000, "n": len(xs)}


def lscpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return f"{fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} CPUs"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--words", type=int, default=60, help="sentences in each trial's system prompt")
    ap.add_argument("--shared", action="store_true", help="share_cache_across_keys = true (the channel open)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "cache_isolation.json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rng = random.Random(args.seed)
    os.environ["HEADRACE_SERVER_API_KEYS"] = KEY_B  # beside --api-key KEY_A: two keys
    with tempfile.TemporaryDirectory(prefix="cache-isolation-") as tmp:
        daemon = DaemonProcess(config_file(Path(tmp), args.shared), api_key=KEY_A).wait_ready()
        try:
            times: dict[str, list[float]] = {k: [] for k in KINDS}
            cached: dict[str, list[int]] = {k: [] for k in KINDS}
            prompt_tokens = []
            with httpx.Client(base_url=daemon.base_url, timeout=600) as http:
                ttft(http, KEY_A, prompt(-1, args.words), None)  # warm-up: the template's opening cached for A
                ttft(http, KEY_B, prompt(-1, args.words), None)
                ttft(http, KEY_A, prompt(-1, args.words), "warm-up")
                cpu = CPUWatch([daemon.proc.pid])
                for trial in range(args.trials):
                    messages = prompt(trial, args.words)
                    kinds = ["same key", "cross key", "cross salt"]
                    rng.shuffle(kinds)
                    for kind in ["cold", *kinds]:
                        key = KEY_B if kind == "cross key" else KEY_A
                        # A fresh salt each trial: no one's prefix; its template opening is cold too (16 tokens).
                        salt = f"probe-{uuid.uuid4().hex}" if kind == "cross salt" else None
                        seconds, hit, n = ttft(http, key, messages, salt)
                        times[kind].append(seconds)
                        cached[kind].append(hit)
                    prompt_tokens.append(n)
                cores = cpu.cores()
        finally:
            daemon.close()
    res = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "cpu": lscpu_model(),
           "shared_across_keys": args.shared, "trials": args.trials,
           "prompt_tokens_median": statistics.median(prompt_tokens), "cpu_cores": cores,
           "ttft": {k: quantiles(v) for k, v in times.items()},
           "cached_tokens": {k: {"min": min(v), "max": max(v)} for k, v in cached.items()},
           "vs_cold": {k: compare(times[k], times["cold"]) for k in KINDS[1:]},
           "raw_ttft_s": times}
    print(f"{res['cpu']}; {args.trials} trials, prompts of {res['prompt_tokens_median']:.0f} tokens, caches "
          f"{'shared across' if args.shared else 'apart by'} keys ({cpu_note(res)})")
    print(f"{'':>11} {'median':>9} {'p10':>9} {'p90':>9} {'cached':>11} {'vs cold: p':>11} {'p(less)':>8} "
          f"{'ratio':>6}")
    for kind in KINDS:
        q, c = res["ttft"][kind], res["cached_tokens"][kind]
        v = res["vs_cold"].get(kind)
        versus = f"{v['p']:>11.3g} {v['p_a_less']:>8.3g} {v['median_ratio']:>6.2f}" if v else ""
        print(f"{kind:>11} {q['median_ms']:>7.1f}ms {q['p10_ms']:>7.1f}ms {q['p90_ms']:>7.1f}ms "
              f"{c['min']:>5}-{c['max']:<5} {versus}")
    write_results(res, args.out, t0)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
