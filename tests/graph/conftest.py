"""Shared fixtures for the graph tests: the default config's real engines, loaded once."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from headrace.graph.service import WorkflowService
from headrace.plugins.manager import collect

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def registry():
    return collect()


@pytest.fixture(scope="session")
def live(tmp_path_factory, registry):
    """(portal, service, pool): the default config's engines behind a workflow service, loaded once."""
    from anyio.from_thread import start_blocking_portal

    from headrace.daemon.config import load_config
    from headrace.daemon.metrics import Metrics
    from headrace.daemon.pool import EnginePool

    data = tmp_path_factory.mktemp("workflows")
    cfg = load_config(ROOT / "configs" / "default.toml", env={}, overrides={"data.dir": str(data)})
    pool = EnginePool(cfg, registry, Metrics())
    with start_blocking_portal() as portal:
        fut, _ = portal.start_task(pool.run)
        deadline = time.monotonic() + 300
        while not pool.ready:
            failed = {s.name: s.error for s in pool.slots.values() if s.state == "failed"}
            assert not failed, f"engines failed to load: {failed}"
            assert time.monotonic() < deadline, "engines not ready after 300 s"
            time.sleep(0.1)
        svc = WorkflowService(registry.workflows, registry.passes, pool.resolve, pool.engines_by_kind,
                              pool.max_efficient_batch, policies=registry.batch_policies)
        try:
            yield portal, svc, pool
        finally:
            fut.cancel()
