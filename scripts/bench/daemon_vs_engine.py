#!/usr/bin/env python3
"""One stream's decode through the daemon against the same engine in this process (issue 51: where the gap to
llama-server lies). Arm ``daemon``: ``headrace serve --config configs/llama-cpp.toml``, streamed
``/v1/completions`` over HTTP. Arm ``engine``: that config's LLM options in a ``LlamaCppLLM`` here, no HTTP.
Both decode the same prompt tokens greedily with ``ignore_eos`` to ``--tokens``; tok/s is counted from the
first token to the last, so prefill is left out. The arms alternate, each started ``--starts`` times (this
VM's speed drifts within minutes); one server at a time.

    python scripts/bench/daemon_vs_engine.py [--starts 3] [--requests 3] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import tomllib
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import anyio
import httpx

from headrace.bench.client import DaemonProcess
from headrace.plugins.engines.llama_cpp.engine import LlamaCppLLM
from headrace.plugins.protocols import EngineEnv, EngineSpec, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "llama-cpp.toml"
QUESTION = "Write a long story about a lighthouse keeper and the ships she watches over."


def llm_entry() -> dict:
    return next(e for e in tomllib.loads(CONFIG.read_text())["engines"] if e["plugin"] == "llama-cpp")


async def engine_arm(prompt: list[int], requests: int, tokens: int) -> list[float]:
    entry = llm_entry()
    env = EngineEnv(data_dir=Path(tempfile.mkdtemp(prefix="daemon-vs-engine-")),
                    cache_dir=Path.home() / ".cache" / "headrace", lookup=lambda name: None,
                    observe_batch=lambda op, n, start, end: None)
    engine = LlamaCppLLM(EngineSpec(name=entry["name"], plugin="llama-cpp", model=entry["model"],
                                    options=dict(entry.get("options", {}))), env)
    rates = []
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        for _ in range(requests):
            first = last = None
            n = 0
            async for delta in engine.generate(prompt, SamplingParams(max_tokens=tokens, temperature=0,
                                                                      ignore_eos=True)):
                now = time.perf_counter()
                first = first or now
                last, n = now, n + len(delta.token_ids)
            rates.append((n - 1) / (last - first))
        tg.cancel_scope.cancel()
    return rates


def daemon_arm(prompt_text: str, model: str, requests: int, tokens: int) -> list[float]:
    daemon = DaemonProcess(CONFIG).wait_ready()
    rates = []
    try:
        headers = {"Authorization": f"Bearer {daemon.api_key}"}
        for _ in range(requests):
            first = last = None
            n = 0
            body = {"model": model, "prompt": prompt_text, "max_tokens": tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            with httpx.Client(timeout=600) as http, http.stream("POST", f"{daemon.base_url}/v1/completions",
                                                                 json=body, headers=headers) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    if json.loads(line[6:])["choices"][0]["text"]:
                        now = time.perf_counter()
                        first = first or now
                        last, n = now, n + 1
            rates.append((n - 1) / (last - first))  # one SSE chunk a token
    finally:
        daemon.close()
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    entry = llm_entry()
    from headrace.plugins.engines.llama_cpp.files import load_tokenizer
    from headrace.plugins.engines.models.paths import resolve_model

    # The prompt's tokens as the daemon's tokenizer makes them from the same text.
    tokenizer = load_tokenizer(resolve_model(entry["model"]), Path.home() / ".cache" / "headrace")
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                         add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    medians: dict[str, list[float]] = {"daemon": [], "engine": []}
    for start in range(args.starts):
        for arm in ("daemon", "engine") if start % 2 == 0 else ("engine", "daemon"):
            rates = (daemon_arm(text, entry["name"], args.requests, args.tokens) if arm == "daemon"
                     else anyio.run(engine_arm, prompt, args.requests, args.tokens))
            medians[arm].append(statistics.median(rates))
            print(f"start {start + 1} {arm:6s}: " + " ".join(f"{r:.1f}" for r in rates) + " tok/s", flush=True)
    daemon, engine = (statistics.median(medians[a]) for a in ("daemon", "engine"))
    print(f"daemon {daemon:.1f} tok/s, engine in-process {engine:.1f} tok/s (medians of {args.starts} starts): "
          f"daemon / engine {daemon / engine:.3f}x")


if __name__ == "__main__":
    main()
