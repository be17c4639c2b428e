"""Faults stay where they start (issue 9): engine pool supervision, and bad items beside good ones on the daemon.

The pool tests use tiny real engines (upper-casing text) that die on demand; the
daemon tests send bad requests beside normal ones to the real default engines.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest

from headrace.batching.policies import FifoPolicy
from headrace.batching.requests import EmbedRequest
from headrace.daemon.config import Config, DataConfig, EngineConfig
from headrace.daemon.metrics import Metrics
from headrace.daemon.pool import EnginePool
from headrace.plugins.manager import Registry

from conftest import API_KEY, metric_value

# ----- pool supervision, on tiny engines ---------------------------------------------------


class Upper:
    """An embed-kind engine that upper-cases texts; ``die`` ends its run with an error."""

    kind = "embed"
    dimensions = 1

    def __init__(self, spec, env) -> None:
        self.name = spec.name
        self.die = anyio.Event()

    async def run(self, *, task_status) -> None:
        task_status.started()
        await self.die.wait()
        raise RuntimeError("the device fell off")

    async def embed(self, texts):
        return [t.upper() for t in texts]


class CrashingMetrics(Metrics):
    """Metrics whose scheduler hook raises while ``crashes`` is positive: a bug inside the loop."""

    crashes = 0

    def started(self, engine: str, queue_seconds: float) -> None:
        if self.crashes:
            self.crashes -= 1
            raise RuntimeError("observer bug")
        super().started(engine, queue_seconds)


def make_pool(tmp_path: Path, metrics: Metrics, names=("a", "b")) -> EnginePool:
    config = Config(data=DataConfig(dir=str(tmp_path), cache_dir=str(tmp_path)),
                    engines=[EngineConfig(name=n, plugin="upper") for n in names])
    return EnginePool(config, Registry(engines={"upper": Upper}, batch_policies={"fifo": FifoPolicy}), metrics)


async def wait_until(predicate, timeout: float = 30) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.01)


@asynccontextmanager
async def serving(pool: EnginePool):
    """The pool's engines loaded and served until the block ends."""
    async with anyio.create_task_group() as tg:
        await tg.start(pool.run)
        await wait_until(lambda: pool.ready)
        yield
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_a_crashed_scheduler_loop_is_restarted(tmp_path):
    metrics = CrashingMetrics()
    pool = make_pool(tmp_path, metrics)
    async with serving(pool):
        sched = pool.resolve("a").batch()
        metrics.crashes = 2
        for _ in range(2):  # the batch in flight when the loop crashed fails; nothing hangs
            with pytest.raises(RuntimeError, match="scheduler stopped"):
                await sched.submit(EmbedRequest(("x",)), 1)
        with anyio.fail_after(30):
            assert await sched.submit(EmbedRequest(("x",)), 1) == ["X"]
        assert pool.ready and pool.health().alive and pool.health().problems == {}
        assert metric_value(metrics.render().decode(), "headrace_scheduler_restarts_total", engine="a") == 2


@pytest.mark.anyio
async def test_a_scheduler_loop_that_keeps_crashing_is_given_up(tmp_path):
    metrics = CrashingMetrics()
    pool = make_pool(tmp_path, metrics)
    async with serving(pool):
        sched = pool.resolve("a").batch()
        metrics.crashes = 1000
        while pool.slots["a"].state == "ready":
            with pytest.raises(RuntimeError):
                await sched.submit(EmbedRequest(("x",)), 1)
        health = pool.health()
        assert not health.alive and "crashed" in health.problems["a"] and not pool.ready
        with pytest.raises(LookupError):
            pool.resolve("a")
        # The other engine serves on.
        metrics.crashes = 0
        assert await pool.resolve("b").batch().submit(EmbedRequest(("y",)), 1) == ["Y"]


@pytest.mark.anyio
async def test_an_engine_that_dies_fails_its_slot_only(tmp_path):
    metrics = Metrics()
    pool = make_pool(tmp_path, metrics)
    async with serving(pool):
        assert pool.health().alive
        pool.slots["a"].engine.die.set()
        await wait_until(lambda: pool.slots["a"].state == "failed")
        health = pool.health()
        assert not health.alive and "device fell off" in health.problems["a"] and "b" not in health.problems
        assert not pool.ready and pool.engines_by_kind() == {"embed": "b"}
        assert await pool.resolve("b").batch().submit(EmbedRequest(("y",)), 1) == ["Y"]
        assert metric_value(metrics.render().decode(), "headrace_engine_failures_total", engine="a") == 1


# ----- one bad item beside normal ones, on the real daemon ------------------------------------

LLM, EMBEDDER, RERANKER = "smollm2", "all-minilm-l6-v2", "smollm2-rerank"


async def post_all(server, path: str, bodies: list[dict]) -> list[httpx.Response]:
    """POST the bodies at once. Encoded by hand: ensure_ascii escapes a lone surrogate as JSON allows."""
    import json

    out: list = [None] * len(bodies)
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=server.base_url, headers=headers, timeout=300) as client:

        async def one(i: int) -> None:
            out[i] = await client.post(path, content=json.dumps(bodies[i]).encode())

        async with anyio.create_task_group() as tg:
            for i in range(len(bodies)):
                tg.start_soon(one, i)
    return out


async def still_serving(server) -> None:
    [ok] = await post_all(server, "/v1/embeddings", [{"model": EMBEDDER, "input": "still here"}])
    assert ok.status_code == 200
    assert httpx.get(f"{server.base_url}/ready").status_code == 200


def refused_cleanly(response: httpx.Response, param: str) -> bool:
    """The bad request: a 400 with OpenAI's error envelope naming the bad field; neither served nor a 5xx."""
    error = response.json().get("error") or {}
    return response.status_code == 400 and set(error) == {"message", "type", "param", "code"} and error["param"] == param


@pytest.mark.slow
@pytest.mark.anyio
async def test_out_of_vocabulary_completion_beside_six_normal(server):
    normal = [{"model": LLM, "prompt": f"Count to {i}:", "max_tokens": 6, "temperature": 0} for i in range(6)]
    bad = {"model": LLM, "prompt": [1, 2, 50000], "max_tokens": 6}
    *answers, refused = await post_all(server, "/v1/completions", normal + [bad])
    assert [r.status_code for r in answers] == [200] * 6, [r.text for r in answers]
    assert refused_cleanly(refused, "prompt[2]"), refused.text
    await still_serving(server)


@pytest.mark.slow
@pytest.mark.anyio
async def test_surrogate_embedding_beside_eight_normal(server):
    normal = [{"model": EMBEDDER, "input": f"normal text {i}"} for i in range(8)]
    *answers, bad = await post_all(server, "/v1/embeddings", normal + [{"model": EMBEDDER, "input": "\ud800"}])
    assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers]
    assert all(len(r.json()["data"][0]["embedding"]) == 384 for r in answers)
    assert refused_cleanly(bad, "input"), bad.text
    await still_serving(server)


@pytest.mark.slow
@pytest.mark.anyio
async def test_surrogate_rerank_document_beside_four_normal(server):
    docs = ["Paris is the capital of France.", "Bananas are yellow."]
    normal = [{"model": RERANKER, "query": f"capital of France {i}", "documents": docs} for i in range(4)]
    bad = {"model": RERANKER, "query": "capital of France", "documents": ["fine", "bad \ud800 doc"]}
    *answers, refused = await post_all(server, "/v1/rerank", normal + [bad])
    assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
    assert all(len(r.json()["results"]) == 2 for r in answers)
    assert refused_cleanly(refused, "documents[1]"), refused.text
    await still_serving(server)
