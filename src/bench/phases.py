"""What the program-level benchmarks' phases (``agents_phase``, ``mixed_phase``) share: the modes switched
on the daemon (``use_mode``, ``measure_point``), the daemon's tokenizer, deltas of its /metrics text, and
the reports' figure format.

A mode is a set of LLM engine settings (``AGENT_MODES``: policy, prefix caching, retention) patched on the
running daemon (``PATCH /v1/engines/{engine}``) and put back after it, so a shared daemon serves on as it was;
a memory-pressure point adds the prefix cache's budget (and its pins') to every mode's settings.
"""

from __future__ import annotations

import math
import re
from typing import Any, Awaitable, Callable, Collection

from headrace.bench.agents import AGENT_MODES
from headrace.bench.client import BenchError

SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$')
LABEL = re.compile(r'(\w+)="([^"]*)"')
TTFT = "headrace_time_to_first_token_seconds"
E2E = "headrace_e2e_request_latency_seconds"  # observed once per finished request: the daemon's request count


def samples(text: str, model: str) -> dict[tuple[str, str], float]:
    """(metric name, its ``le`` label, or its other labels as ``k=v,...``, or "") -> value, for the samples of
    ``model`` in Prometheus text (so ``headrace_kv_tier_hits_total{tier="host"}`` and ``{tier="disk"}`` stay apart)."""
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if not m or line.startswith("#"):
            continue
        labels = dict(LABEL.findall(m["labels"] or ""))
        if labels.get("model") == model:
            rest = ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "model")
            out[(m["name"], labels.get("le", rest))] = float(m["value"])
    return out


def deltas(before: str, after: str, model: str) -> dict[tuple[str, str], float]:
    old = samples(before, model)
    return {key: value - old.get(key, 0.0) for key, value in samples(after, model).items()}


def histogram_quantile(delta: dict[tuple[str, str], float], name: str, q: float) -> float | None:
    """Prometheus's ``histogram_quantile`` over the delta of one histogram's buckets."""
    buckets = sorted((math.inf if le == "+Inf" else float(le), count)
                     for (metric, le), count in delta.items() if metric == f"{name}_bucket")
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower  # past the last finite bound: that bound, as Prometheus answers
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower



def fmt(x: Any, spec: str = ".2f") -> str:
    """A figure for a report line; None (not measured) as "-"."""
    return "-" if x is None else format(x, spec)


def daemon_tokenizer(systems: Any) -> tuple[Callable, Callable]:
    """(tokenize, detokenize) in the daemon's LLM's own tokens, through its /tokenize and /detokenize."""
    daemon, llm = systems.daemon, systems.models["llm"]

    async def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await daemon.http.post(path, json=body)
        if response.status_code >= 400:
            raise BenchError(f"POST {path}: HTTP {response.status_code}: {response.text[:500]}")
        return response.json()

    async def tokenize(text: str) -> list[int]:
        return (await post("/tokenize", {"model": llm, "prompt": text, "add_special_tokens": False}))["tokens"]

    async def detokenize(tokens: list[int]) -> str:
        return (await post("/detokenize", {"model": llm, "tokens": tokens}))["prompt"]

    return tokenize, detokenize


async def measure_point(systems: Any, modes: list[str], index: int, point: dict[str, Any],
                        measure: Callable[[str], Awaitable[dict[str, Any]]],
                        logged: Callable[[str, dict[str, Any]], None],
                        compare: Callable[[dict[str, dict[str, Any]]], dict[str, Any]],
                        elsewhere: Collection[str] = ()) -> dict[str, Any]:
    """A load point's row in each mode, each mode in its own settings (restored after it), and their ratios.
    The order rotates from point to point, so drift (other load on the machine) hits every mode alike. A
    memory-pressure budget is the phase's, set once with its base mode; every mode keeps that size. Modes in
    ``elsewhere`` are served by another daemon (``measure`` brings it): this one's settings stay as they are."""
    rows = {}
    for mode in modes[index % len(modes):] + modes[:index % len(modes)]:
        restore = {} if mode in elsewhere else await use_mode(systems, mode, {})
        try:
            rows[mode] = await measure(mode)
        finally:
            await use_mode(systems, None, restore)
        logged(mode, rows[mode])
    point["order"] = list(rows)
    point["modes"] = {mode: rows[mode] for mode in modes}
    point["ratios"] = compare(point["modes"])
    return point


async def use_mode(systems: Any, mode: str | None, restore: dict[str, Any],
                   budget: tuple[int, int | None] | None = None) -> dict[str, Any]:
    """Put the LLM in ``mode``'s settings with an empty prefix cache; returns the other settings it changed, with
    their old values (``mode`` None: put those back). ``budget``: (prefix cache tokens, pin tokens; None: the
    configured share) for a memory-pressure point, set through the same PATCH and put back with the rest."""
    llm = systems.models["llm"]
    if mode is None:
        if restore:
            await systems.daemon.engine_settings(llm, **restore)
        return {}
    settings = dict(AGENT_MODES[mode])
    await systems.use_policy(settings.pop("llm_policy", "fifo"))
    caching = settings.pop("prefix_caching", True)
    await systems.use_prefix_caching(False)  # empties it: each mode starts cold
    if caching:
        await systems.use_prefix_caching(True)
    current = await systems.daemon.engine_settings(llm)
    if current.get("retention") is None and not settings.get("retention", True):
        settings.pop("retention")  # an engine without pins retains nothing anyway
    if budget is not None:
        settings["prefix_cache_tokens"] = budget[0]
        if budget[1] is not None:
            settings["prefix_cache_pin_tokens"] = budget[1]
    if not settings:
        return {}
    await systems.daemon.engine_settings(llm, **settings)
    old = {key: current.get(key) for key in settings}
    if budget is not None:  # the pins' budget moved with the cache's, given or not
        old["prefix_cache_pin_tokens"] = current.get("prefix_cache_pin_tokens")
    return old
