"""The daemons ``headrace bench rag-repeat`` measures: a config copy per mode, a daemon on a data dir of the
caller's (the restart phase starts a second daemon on the first one's), and the token counts read from its
/metrics."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any, Iterator

from headrace.bench.client import BenchError, _free_port, dies_with_this_process, poll_ready
from headrace.bench.soak import metric_sum

# Configs and processes --------------------------------------------------------------------------------------------


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise BenchError(f"cannot write {v!r} to a TOML config")


def _toml_key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else json.dumps(k)


def dump_toml(config: dict[str, Any], path: tuple[str, ...] = ()) -> list[str]:
    """``config`` (as tomllib read it) as TOML lines: a daemon config's tables and arrays of tables."""
    def table_array(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)

    lines = [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in config.items()
             if not isinstance(v, dict) and not table_array(v)]
    for k, v in config.items():
        if isinstance(v, dict):
            lines += ["", f"[{'.'.join(map(_toml_key, (*path, k)))}]", *dump_toml(v, (*path, k))]
        elif table_array(v):
            for item in v:
                lines += ["", f"[[{'.'.join(map(_toml_key, (*path, k)))}]]", *dump_toml(item, (*path, k))]
    return lines


def llm_entry(config: dict[str, Any]) -> dict[str, Any]:
    entry = next((e for e in config.get("engines", []) if e.get("plugin") in ("llama-cpp", "torch")), None)
    if entry is None:
        raise BenchError("rag-repeat needs a llama-cpp or torch LLM in the config (its KV tiers are measured)")
    return entry


def mode_config(base: Path, overrides: dict[str, Any], out: Path, rerank: dict[str, Any] | None = None) -> Path:
    """A copy of the daemon config ``base`` with the LLM's options overridden (and every ``llm-rerank`` engine's by
    ``rerank``), written to ``out``."""
    config = tomllib.loads(base.read_text())
    for entry in config.get("engines", []):
        if rerank and entry.get("plugin") == "llm-rerank":
            entry.setdefault("options", {}).update(rerank)
    options = llm_entry(config).setdefault("options", {})
    for key, value in overrides.items():
        if value is None:
            if options.get(key) == 0:  # a tier the config turned off is on in this mode (sized by default)
                del options[key]
        else:
            options[key] = value
    out.write_text("\n".join(dump_toml(config)) + "\n")
    return out


class ModeDaemon:
    """``headrace serve`` on a config and a data dir of the caller's (the restart phase starts a second daemon on
    the first one's), on a free port, until closed. Closing it is a graceful stop (SIGTERM): the engine writes
    its cells' prefixes to the tiers then, as a real restart does."""

    def __init__(self, config: Path, data_dir: Path, log: Path, api_key: str = "bench-key") -> None:
        self.port = _free_port()
        self.base_url, self.api_key, self.log = f"http://127.0.0.1:{self.port}", api_key, log
        self._log_file = log.open("a")
        self.proc = subprocess.Popen([sys.executable, "-m", "headrace.daemon.commands", "serve", "--config",
                                      str(config), "--port", str(self.port), "--data-dir", str(data_dir),
                                      "--api-key", api_key, "--log-level", "warning"],
                                     stdout=self._log_file, stderr=subprocess.STDOUT,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1"},
                                     preexec_fn=dies_with_this_process())

    def wait_ready(self, timeout: float = 600) -> "ModeDaemon":
        ready = poll_ready(f"{self.base_url}/ready", lambda: self.proc.poll() is not None, timeout)
        if not ready:
            self.close()
            said = "exited" if ready is None else f"was not ready after {timeout:.0f}s"
            raise BenchError(f"the daemon {said}:\n{self.log.read_text()[-3000:]}")
        return self

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(120)  # the drain, then the cells' prefixes written to disk
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()


@contextlib.contextmanager
def started(config: Path, data_dir: Path, log: Path) -> Iterator[ModeDaemon]:
    process = ModeDaemon(config, data_dir, log)
    try:
        yield process.wait_ready()
    finally:
        process.close()


# Token counts from /metrics -----------------------------------------------------------------------------------

CACHED_METRIC = "headrace_prompt_cached_tokens_total"  # per request, every tier: used where the daemon has it


def token_counts(before: str, after: str, llm: str) -> dict[str, Any]:
    """The LLM's prompt tokens between two /metrics scrapes, those served from a cache, and the tiers' hits.

    Without a per-request cached-token counter the cached tokens are the cells' prefix-cache hits plus the
    tiers' restored tokens: an upper bound, since a request a tier served also counted the shorter prefix
    the cells held for it (``cached_source`` says which)."""
    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, model=llm, **labels) - metric_sum(before, name, model=llm, **labels)

    prompt = delta("headrace_prompt_tokens_total")
    out: dict[str, Any] = {"prompt_tokens": prompt, "requests": delta("headrace_request_prompt_tokens_count"),
                           "cells_hit_tokens": delta("headrace_prefix_cache_hits_total"),
                           "tiers": {tier: {"hits": delta("headrace_kv_tier_hits_total", tier=tier),
                                            "hit_tokens": delta("headrace_kv_tier_hit_tokens_total", tier=tier),
                                            "restore_s": delta("headrace_kv_tier_restore_seconds_total", tier=tier)}
                                     for tier in ("host", "disk")}}
    if CACHED_METRIC in after:
        out["cached_tokens"], out["cached_source"] = delta(CACHED_METRIC), "per request"
    else:
        tiers = sum(t["hit_tokens"] for t in out["tiers"].values())
        out["cached_tokens"] = min(prompt, out["cells_hit_tokens"] + tiers)
        out["cached_source"] = "cells + tiers (upper bound)"
    out["prefilled_tokens"] = max(0.0, prompt - out["cached_tokens"])
    return out



__all__ = ["ModeDaemon", "started", "mode_config", "dump_toml", "token_counts", "CACHED_METRIC"]
