"""The batch scheduler and the FIFO policy."""

from __future__ import annotations

import anyio
import pytest

from headrace.batching.llm import LLMScheduler
from headrace.batching.meta import PrimitiveMeta
from headrace.batching.policies import FifoPolicy, TopologyPolicy
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
        assert await sched.submit(["y"], 1, PrimitiveMeta(run="r", policy="no-such-policy")) == ["Y"]
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

        async def generate(self, tokens, params, *, priority=0):
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


class Recorder:
    """A batch runner that records each batch's payloads and answers each with itself."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    async def __call__(self, payloads):
        self.batches.append(list(payloads))
        return list(payloads)


async def queue_then_serve(sched: BatchScheduler, requests: list[tuple[str, PrimitiveMeta]]) -> None:
    """Queue ``requests`` in this order before the loop forms its first batch, then serve them all."""

    async def one(payload, meta):
        assert await sched.submit(payload, 1, meta) == payload

    async with anyio.create_task_group() as tg:
        async with anyio.create_task_group() as clients:
            for payload, meta in requests:
                clients.start_soon(one, payload, meta)
                await anyio.wait_all_tasks_blocked()  # queued, in this order
            assert sched.waiting == len(requests)
            await tg.start(sched.run)
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_a_per_run_policy_override_changes_that_runs_order_only():
    """The engine's FIFO gives each run its slots; run a, which asked for topology, fills its slots deepest first.

    Run b keeps FIFO's order: the override neither is ignored nor leaks to the other run
    (the whole batch taken by topology would put b's deep request before its shallow one).
    """
    policies = {"fifo": FifoPolicy(), "topology": TopologyPolicy()}

    def meta(run: str, depth: int) -> PrimitiveMeta:
        return PrimitiveMeta(run=run, node=f"{run}{depth}", depth=depth, policy="topology" if run == "a" else None)

    requests = [("a0", meta("a", 0)), ("b0", meta("b", 0)), ("b2", meta("b", 2)), ("a2", meta("a", 2))]
    runner = Recorder()
    await queue_then_serve(BatchScheduler("rec", runner, FifoPolicy(), max_batch_size=2, max_wait_ms=0,
                                          policies=policies), requests)
    assert runner.batches == [["a2", "b0"], ["a0", "b2"]]

    def order(batches, run):
        return [p for batch in batches for p in batch if p.startswith(run)]

    # Without the override both runs go by FIFO, and an override applied to everyone reorders run b too.
    plain = Recorder()
    await queue_then_serve(BatchScheduler("rec", plain, FifoPolicy(), max_batch_size=2, max_wait_ms=0),
                           [(p, PrimitiveMeta(run=m.run, node=m.node, depth=m.depth)) for p, m in requests])
    everyone = Recorder()
    await queue_then_serve(BatchScheduler("rec", everyone, TopologyPolicy(), max_batch_size=2, max_wait_ms=0),
                           requests)
    assert order(plain.batches, "a") == ["a0", "a2"] != order(runner.batches, "a")
    assert order(everyone.batches, "b") == ["b2", "b0"] != order(runner.batches, "b")


@pytest.mark.anyio
async def test_an_override_keeps_the_slots_the_engine_policy_gave_its_run():
    """A run's own policy picks among the run's requests, within the capacity that run was given."""
    runner = Recorder()
    sched = BatchScheduler("rec", runner, TopologyPolicy(), max_batch_size=3, max_wait_ms=0,
                           policies={"fifo": FifoPolicy(), "topology": TopologyPolicy()})
    a = [(f"a{d}", PrimitiveMeta(run="a", node=f"a{d}", depth=d, policy="fifo")) for d in (0, 1, 2)]
    b = [(f"b{d}", PrimitiveMeta(run="b", node=f"b{d}", depth=d)) for d in (0, 1, 2)]
    await queue_then_serve(sched, [a[0], b[0], a[1], b[1], a[2], b[2]])
    # Topology alone would batch [a2, b2, a1]: run a's two slots are filled oldest first, by its FIFO.
    assert runner.batches == [["a0", "a1", "b2"], ["b1", "a2", "b0"]]


@pytest.mark.anyio
async def test_the_llm_scheduler_keeps_each_contexts_primitive():
    """Prefill and decode carry their metadata; the context keeps the one using it now, until it is freed."""

    class Echo:
        """A real (tiny) LLM-shaped engine: decodes the prompt's tokens back."""

        name, kind = "echo", "llm"

        def __init__(self) -> None:
            self.prompts: dict[str, list[int]] = {}

        async def prefill(self, ctx, tokens, parent=None, *, priority=0):
            self.prompts[ctx] = list(tokens)

        async def decode(self, ctx, params, *, priority=0):
            for token in self.prompts[ctx]:
                yield TokenDelta(text=str(token), token_ids=[token])

        async def free(self, ctx):
            self.prompts.pop(ctx, None)

    sched = LLMScheduler(Echo(), max_running=2)
    fill = PrimitiveMeta(run="r", node="call.prefill", depth=1, prefix_hash="abc")
    answer = PrimitiveMeta(run="r", node="call", depth=0)
    await sched.prefill("c1", [7, 8], meta=fill)
    await sched.prefill("c2", [9])
    assert sched.contexts["c1"].meta == fill and sched.contexts["c1"].prompt_tokens == 2
    assert sched.contexts["c2"].meta is None  # a request from outside any run
    seen = []
    async for delta in sched.decode("c1", SamplingParams(), answer):
        seen.append((delta.text, sched.contexts["c1"].meta))
    assert seen == [("7", answer), ("8", answer)]
    assert "c1" not in sched.contexts
    await sched.free("c2")
    assert sched.contexts == {}
