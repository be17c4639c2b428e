"""What a host KV tier costs in resident memory beyond the bytes it holds, with its payloads from malloc's heaps
against payloads in mappings of their own (``kv_store.payload_buffer``).

A ``KVStore`` with a host budget and no disk takes ``--puts`` entries of llama.cpp-sized states (~23 KiB a
token of SmolLM2-135M, prompts of 64-2,000 tokens: 1.5-45 MB) on a worker thread, as an engine's does, with a
short-lived copy of another entry's size beside each put (a prefix copy's state, freed at once); the budget
evicts the least recently used. Each arm runs in a fresh process (malloc's state is per process) and reports
RSS over what the tier holds, at the budget's first fill and at the end: growth between the two is the heap's
holes, not the tier.

    python scripts/bench/kv_host_memory.py --puts 600 --budget-mib 1024
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading

MiB = 1 << 20
BYTES_PER_TOKEN = 23_040  # SmolLM2-135M's f16 K and V, 30 layers x 2 x 192 values a token


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def arm(mapped: bool, puts: int, budget: int, seed: int) -> dict:
    from headrace.plugins.engines.kvreuse import kv_store

    if not mapped:  # every payload from malloc, as before payload_buffer
        kv_store.payload_buffer = bytearray  # type: ignore[assignment]
    store = kv_store.KVStore("bench", 16, budget, None, 0)
    rng = random.Random(seed)
    marks: dict = {}

    def work() -> None:
        base = rss_mib()
        for i in range(puts):
            n = rng.randrange(64, 2000) // 16 * 16
            payload = kv_store.payload_buffer(n * BYTES_PER_TOKEN)
            payload[:: 4096] = b"\1" * len(payload[:: 4096])  # every page written, as llama.cpp writes a state
            transient = kv_store.payload_buffer(rng.randrange(64, 2000) * BYTES_PER_TOKEN)
            transient[:: 4096] = b"\1" * len(transient[:: 4096])
            del transient
            store.put([i * 100_003 % 49_152 + t for t in range(n)], payload)
            del payload
            if "full" not in marks and store.host_used > 0.9 * budget:
                marks["full"] = {"put": i, "rss_over_held_mib": rss_mib() - base - store.host_used / MiB}
        marks["end"] = {"put": puts, "rss_over_held_mib": rss_mib() - base - store.host_used / MiB,
                        "held_mib": store.host_used / MiB}

    thread = threading.Thread(target=work)  # a thread arena, as the engine's worker thread gets
    thread.start()
    thread.join()
    return marks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--puts", type=int, default=600)
    p.add_argument("--budget-mib", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arm", choices=["malloc", "mapped"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.arm:
        print(json.dumps(arm(args.arm == "mapped", args.puts, args.budget_mib * MiB, args.seed)))
        return
    out = {}
    for name in ("malloc", "mapped"):
        done = subprocess.run([sys.executable, __file__, "--arm", name, "--puts", str(args.puts), "--budget-mib",
                               str(args.budget_mib), "--seed", str(args.seed)], capture_output=True, text=True,
                              check=True, env={**os.environ})
        out[name] = json.loads(done.stdout)
        full, end = out[name]["full"], out[name]["end"]
        print(f"{name:>7}: RSS over the tier's held bytes {full['rss_over_held_mib']:7.1f} MiB when it first filled "
              f"(put {full['put']}), {end['rss_over_held_mib']:7.1f} MiB after {end['put']} puts "
              f"(held {end['held_mib']:.0f} MiB of {args.budget_mib})")


if __name__ == "__main__":
    main()
