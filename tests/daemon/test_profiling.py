"""``headrace profile``'s probes, on the real LanceDB store (the CLI test covers the embedder end to end)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from headrace.daemon.config import ConfigError
from headrace.daemon.profiling import ITEMS, SCRATCH_TABLE, items_per_second, probe_for, sentences
from headrace.plugins.engines.retrieval import lancedb_store
from headrace.plugins.protocols import EngineEnv, EngineSpec

from conftest import running

pytestmark = pytest.mark.anyio


def test_every_size_measures_the_same_sentences():
    # A size must not be measured on shorter text than another (the first sentences alone).
    assert sentences(ITEMS)[:8] == sentences(8) and len(set(sentences(ITEMS))) > 8


async def test_the_vector_store_probe_searches_a_scratch_table_it_drops(tmp_path: Path):
    env = EngineEnv(data_dir=tmp_path, cache_dir=tmp_path, lookup=lambda name: None)
    store = lancedb_store.factory(EngineSpec(name="vs", plugin="lancedb", options={}), env)
    async with running(store):
        probe = probe_for(store)
        async with probe.scratch():
            assert len(await store.search(SCRATCH_TABLE, torch.randn(1, 384), 4)) == 1
            assert await items_per_second(probe, 8, repeats=1) > 0
        with pytest.raises(lancedb_store.CollectionNotFound):
            await store.search(SCRATCH_TABLE, torch.randn(1, 384), 4)


def test_an_engine_kind_without_a_probe_is_a_config_error():
    class Tool:
        kind, name = "tool", "calc"

    with pytest.raises(ConfigError, match="engines.calc: cannot profile a tool engine"):
        probe_for(Tool())
