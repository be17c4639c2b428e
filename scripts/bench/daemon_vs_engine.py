#!/usr/bin/env python3
"""One stream's decode through the daemon against the same engine in this process, and against llama-server
(issue 51: where the gap to llama-server lies). Arm ``daemon``: ``headrace serve --config
configs/llama-cpp.toml``, streamed ``/v1/completions`` over HTTP. Arm ``engine``: that config's LLM options in a
``LlamaCppLLM`` here, no HTTP. Arm ``llama-server`` (with ``--llama-server``): llama.cpp's server as
``peers.py`` starts it, on the GGUF the engine loads, the same request as the daemon's. Each decodes the same
prompt greedily with ``ignore_eos`` to ``--tokens``; tok/s is counted from the first token to the last, so
prefill is left out. The arms take turns in a rotating order, each started ``--starts`` times (this VM's speed
drifts within minutes); one server at a time.

    python scripts/bench/daemon_vs_engine.py [--starts 3] [--requests 3] [--tokens 128] [--llama-server]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
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


def http_rates(base_url: str, headers: dict[str, str], prompt_text: str, model: str, requests: int,
               tokens: int, extra: dict | None = None) -> list[float]:
    rates = []
    for _ in range(requests):
        first = last = None
        n = 0
        body = {"model": model, "prompt": prompt_text, "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, **(extra or {})}
        with httpx.Client(timeout=600) as http, http.stream("POST", f"{base_url}/v1/completions",
                                                             json=body, headers=headers) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices")
                if choices and choices[0].get("text"):
                    now = time.perf_counter()
                    first = first or now
                    last, n = now, n + 1
        rates.append((n - 1) / (last - first))  # one SSE chunk a token (both servers stream token by token)
    return rates


def daemon_arm(prompt_text: str, model: str, requests: int, tokens: int) -> list[float]:
    daemon = DaemonProcess(CONFIG).wait_ready()
    try:
        return http_rates(daemon.base_url, {"Authorization": f"Bearer {daemon.api_key}"}, prompt_text, model,
                          requests, tokens)
    finally:
        daemon.close()


def llama_server_arm(prompt_text: str, model: str, requests: int, tokens: int) -> list[float]:
    sys.path.insert(0, str(Path(__file__).parent))
    import peers  # the peer exactly as peers.py starts it: same GGUF, threads, slots and variant

    pair = peers.llama_server_pair()
    if isinstance(pair, str):
        raise SystemExit(f"llama-server: {pair}")
    with tempfile.TemporaryDirectory(prefix="daemon-vs-engine-") as tmp, \
            peers.running(pair.peer, Path(tmp), 600) as (base, _, _):
        return http_rates(base, {}, prompt_text, model, requests, tokens, pair.peer.body_extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--llama-server", action="store_true", help="a third arm: llama.cpp's llama-server")
    args = ap.parse_args()
    entry = llm_entry()
    from headrace.plugins.engines.llama_cpp.files import load_tokenizer
    from headrace.plugins.engines.models.paths import resolve_model

    # The prompt's tokens as the daemon's tokenizer makes them from the same text.
    tokenizer = load_tokenizer(resolve_model(entry["model"]), Path.home() / ".cache" / "headrace")
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                         add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    arms = ["daemon", "engine", *(["llama-server"] if args.llama_server else [])]
    medians: dict[str, list[float]] = {arm: [] for arm in arms}
    for start in range(args.starts):
        for arm in arms[start % len(arms):] + arms[:start % len(arms)]:  # each arm first in turn
            if arm == "engine":
                rates = anyio.run(engine_arm, prompt, args.requests, args.tokens)
            else:
                rates = (daemon_arm if arm == "daemon" else llama_server_arm)(text, entry["name"], args.requests,
                                                                               args.tokens)
            medians[arm].append(statistics.median(rates))
            print(f"start {start + 1} {arm:12s}: " + " ".join(f"{r:.1f}" for r in rates) + " tok/s", flush=True)
    rate = {arm: statistics.median(medians[arm]) for arm in arms}
    print(", ".join(f"{arm} {rate[arm]:.1f} tok/s" for arm in arms) + f" (medians of {args.starts} starts): "
          f"daemon / engine {rate['daemon'] / rate['engine']:.3f}x"
          + (f", daemon / llama-server {rate['daemon'] / rate['llama-server']:.3f}x, "
             f"engine / llama-server {rate['engine'] / rate['llama-server']:.3f}x" if args.llama_server else ""))


if __name__ == "__main__":
    main()
