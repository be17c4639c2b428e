"""The batch scheduler and the FIFO policy."""

from __future__ import annotations

import anyio
import pytest

from headrace.batching.llm import LLMScheduler
from headrace.batching.policies import FifoPolicy
from headrace.batching.queue import Pending
from headrace.batching.scheduler import BatchScheduler
from headrace.plugins.protocols import SamplingParams, TokenDelta

def test_fifo_takes_oldest_whole_requests_until_full():
    queue = [Pending(payload=i, size=s) for i, s in enumerate([3, 2, 4, 1])]
    assert [p.payload for p in FifoPolicy().select(queue, 5)] == [0, 1]
    assert [p.payload for p in FifoPolicy().select(queue, 4)] == [0]
    # An oversized request runs alone instead of starving.
    assert [p.payload for p in FifoPolicy().select([Pending("big", 9), Pending("x", 1)], 4)] == ["big"]


class Upper:
    """A real batch function: upper-cases every text of every request, recording batch sizes."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.batches: list[int] = []
        self.fail_on = fail_on

    async def __call__(self, payloads):
        self.batches.append(sum(len(p) for p in payloads))
        await anyio.sleep(0.01)
        if self.fail_on and any(self.fail_on in p for p in payloads):
            raise RuntimeError("bad text")
        return [[t.upper() for t in p] for p in payloads]


async def serve(scheduler, body):
    async with anyio.create_task_group() as tg:
        await tg.start(scheduler.run)
        await body()
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_concurrent_requests_batch_up_to_the_max():
    runner = Upper()
    sched = BatchScheduler("upper", runner, FifoPolicy(), max_batch_size=4, max_wait_ms=50)
    results = {}

    async def body():
        async def one(i):
            results[i] = await sched.submit([f"t{i}"], 1)

        async with anyio.create_task_group() as tg:
            for i in range(10):
                tg.start_soon(one, i)

    await serve(sched, body)
    assert results == {i: [f"T{i}"] for i in range(10)}
    assert runner.batches == [4, 4, 2]


@pytest.mark.anyio
async def test_a_lone_request_does_not_wait_for_a_full_batch():
    sched = BatchScheduler("upper", Upper(), FifoPolicy(), max_batch_size=64, max_wait_ms=20)

    async def body():
        # A hang guard, not a speed target: the batch never fills, max_wait must end the wait.
        with anyio.fail_after(60):
            assert await sched.submit(["x"], 1) == ["X"]

    await serve(sched, body)


@pytest.mark.anyio
async def test_cancelled_request_never_runs_and_errors_reach_their_batch():
    runner = Upper(fail_on="boom")
    sched = BatchScheduler("upper", runner, FifoPolicy(), max_batch_size=8, max_wait_ms=100)

    async def body():
        with anyio.move_on_after(0.02):
            await sched.submit(["never"], 1)
        assert sched.waiting == 0
        with pytest.raises(RuntimeError, match="bad text"):
            await sched.submit(["boom"], 1)

    await serve(sched, body)
    assert runner.batches == [1]


@pytest.mark.anyio
async def test_a_request_cancelled_inside_max_wait_leaves_the_loop_serving():
    """The queue empties while the loop waits for the batch to fill (issue 9, part 1)."""
    runner = Upper()
    sched = BatchScheduler("upper", runner, FifoPolicy(), max_batch_size=8, max_wait_ms=30)
    loop_ended = anyio.Event()

    async def loop():
        try:
            await sched.run()
        finally:
            loop_ended.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(loop)
        for _ in range(3):
            with anyio.move_on_after(0.005):
                await sched.submit(["gone"], 1)
            # Let the loop reach its max_wait deadline with nobody left in the queue.
            await anyio.sleep(0.1)
            assert not loop_ended.is_set()
        with anyio.fail_after(60):
            assert await sched.submit(["still"], 1) == ["STILL"]
        assert not loop_ended.is_set()
        tg.cancel_scope.cancel()
    assert all(n == 1 for n in runner.batches) and len(runner.batches) == 1  # "gone" never ran


@pytest.mark.anyio
async def test_a_poisonous_payload_fails_alone_and_the_rest_of_its_batch_succeeds():
    runner = Upper(fail_on="boom")
    sched = BatchScheduler("upper", runner, FifoPolicy(), max_batch_size=8, max_wait_ms=1000)
    results: dict = {}

    async def one(text):
        try:
            results[text] = await sched.submit([text], 1)
        except RuntimeError as exc:
            results[text] = exc

    async def body():
        async with anyio.create_task_group() as tg:
            for text in ["a", "b", "c", "boom", "d", "e", "f", "g"]:
                tg.start_soon(one, text)
        # The loop survived: a later batch still runs.
        assert await sched.submit(["h"], 1) == ["H"]

    await serve(sched, body)
    assert isinstance(results.pop("boom"), RuntimeError)
    assert results == {t: [t.upper()] for t in "abcdefg"}
    assert runner.batches[0] == 8  # they did share a batch before it was split


@pytest.mark.anyio
async def test_a_misbehaving_policy_or_runner_never_ends_the_loop():
    class Broken:
        name = "broken"

        def select(self, queue, capacity):
            raise RuntimeError("policy bug")

    async def short(payloads):
        return []  # one result short

    sched = BatchScheduler("upper", Upper(), Broken(), max_batch_size=4, max_wait_ms=1,
                           policies={"fifo": FifoPolicy()})
    wrong = BatchScheduler("short", short, FifoPolicy(), max_batch_size=4, max_wait_ms=1)

    async def body():
        assert await sched.submit(["x"], 1) == ["X"]  # the oldest runs alone
        assert await sched.submit(["y"], 1, {"policy": ["unhashable"]}) == ["Y"]
        with pytest.raises(RuntimeError, match="0 results for 1"):
            await wrong.submit(["z"], 1)

    async with anyio.create_task_group() as tg:
        await tg.start(wrong.run)
        await serve(sched, body)
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_llm_admission_bounds_running_requests():
    class Counter:
        """A real (tiny) LLM-shaped engine: counts up, one token per step."""

        name, kind = "counter", "llm"
        peak = running = 0

        async def generate(self, tokens, params):
            Counter.running += 1
            Counter.peak = max(Counter.peak, Counter.running)
            try:
                for i in range(3):
                    await anyio.sleep(0.01)
                    yield TokenDelta(text=str(i), token_ids=[i])
            finally:
                Counter.running -= 1

    sched = LLMScheduler(Counter(), max_running=2)

    async def one():
        async for _ in sched.generate([1], SamplingParams()):
            pass

    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(one)
    assert Counter.peak == 2 and sched.running == 0 and sched.waiting == 0
