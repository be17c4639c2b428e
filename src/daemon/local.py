"""In-process use of the daemon's engines, for the command line: `headrace run` and `headrace profile`."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, AsyncIterator

from headrace.daemon.compose import compose
from headrace.daemon.config import Config, ConfigError
from headrace.daemon.pool import EnginePool
from headrace.graph.run_history import timeline
from headrace.graph.service import WorkflowService
from headrace.graph.workflow import UnknownWorkflow, WorkflowInputError
from headrace.plugins.manager import collect


@asynccontextmanager
async def engines(config: Config, only: set[str] | None = None) -> AsyncIterator[tuple[EnginePool, WorkflowService]]:
    """The config's engines loaded in this process (only those named in ``only``), with a workflow service over them."""
    if only is not None:
        config = replace(config, engines=[e for e in config.engines if e.name in only],
                         residency=replace(config.residency,
                                           pinned=[name for name in config.residency.pinned if name in only]))
    async with compose(config).serving() as daemon:
        failed = await daemon.pool.wait_loaded()
        if failed:
            raise ConfigError("engines", "failed to load: " + "; ".join(f"{name}: {why}" for name, why in failed.items()))
        yield daemon.pool, daemon.workflows


def parse_inputs(pairs: list[str], schema: dict[str, Any]) -> dict[str, Any]:
    """``key=value`` pairs: a value is JSON if it parses, ``@path`` reads a file; repeated keys make a list."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise WorkflowInputError(f"--input {pair}", "expected key=value")
        if raw.startswith("@"):
            try:
                value: Any = Path(raw[1:]).read_text()
            except (OSError, UnicodeDecodeError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                raise WorkflowInputError(f"--input {key}", f"cannot read {raw[1:]}: {reason}") from None
        else:
            try:
                value = json.loads(raw)
            except json.JSONDecodeError:
                value = raw
        if schema.get(key, {}).get("type") == "string" and not isinstance(value, str):
            value = raw  # "42" for a string field stays a string
        if key in out:
            out[key] = (out[key] if isinstance(out[key], list) else [out[key]]) + [value]
        elif schema.get(key, {}).get("type") == "array" and not isinstance(value, list):
            out[key] = [value]
        else:
            out[key] = value
    return out


async def run_workflow(config: Config, name: str, pairs: list[str], run_config: dict[str, Any]) -> int:
    workflow = collect().workflows.get(name)
    if workflow is None:
        raise UnknownWorkflow(name)
    inputs = parse_inputs(pairs, workflow.inputs)
    workflow.validate(inputs, run_config)  # a bad input fails before any model loads
    async with engines(config) as (_, service):
        run = await service.run(name, inputs, run_config)
    print(json.dumps({"status": run.status, "result": run.result, "error": run.error}, indent=2, default=repr))
    print(f"\n{'node':<34} {'key':<8} {'engine':<18} {'start':>8} {'end':>8}")
    for r in timeline(run):
        key = ",".join(map(str, r["key"]))
        print(f"{r['node']:<34} {key:<8} {r['engine'] or '-':<18} {r['start']:>8.3f} {(r['end'] or 0):>8.3f}")
    return 0 if run.status == "succeeded" else 1
