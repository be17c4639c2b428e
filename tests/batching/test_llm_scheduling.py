"""LLM scheduling policies on the real torch engine (the session's, conftest's ``torch_smollm2``): whose prefill
the engine runs first when it is busy.

Ayo's Figure 7 case for the LLM: two runs' requests queue together on a busy
engine whose iteration holds one prompt; ``fifo`` serves them in arrival order,
interleaving the runs, while ``topology`` finishes the older run's requests first,
deepest node first. Also: a run's own policy reorders that run only, ``objective``
puts latency-critical requests first, and the admission queue follows the same
order when ``max_running`` is reached.
"""

from __future__ import annotations

import time

import anyio
import pytest

from headrace.batching.llm import LLMScheduler, PriorityGate
from headrace.batching.llm_policies import (
    DeadlineLLMPolicy,
    FifoLLMPolicy,
    LasLLMPolicy,
    ObjectiveLLMPolicy,
    TopologyLLMPolicy,
    priority,
    register_llm_policies,
)
from headrace.batching.meta import PrimitiveMeta
from headrace.plugins.protocols import SamplingParams, TokenDelta

PROMPT_TOKENS = 96  # each queued prompt; one fits an iteration, two do not
# The prompt that keeps the engine busy while the others queue: they queue within one turn of the event loop, so a
# prefill of tenths of a second is long enough (1,500 tokens took ~14 s each time on a busy 2-core machine).
BLOCKER_TOKENS = 384
POLICIES = {"fifo": FifoLLMPolicy(), "topology": TopologyLLMPolicy(), "objective": ObjectiveLLMPolicy(),
            "deadline": DeadlineLLMPolicy(), "las": LasLLMPolicy()}


def test_the_builtin_llm_policies_register():
    registered = {}
    register_llm_policies(register=lambda name, factory: registered.setdefault(name, factory))
    assert {name: factory().name for name, factory in registered.items()} == {
        "fifo": "fifo", "topology": "topology", "objective": "objective", "deadline": "deadline", "las": "las"}


def test_policy_ranks():
    """Lower runs first: topology by run arrival then depth; objective puts latency-critical requests first."""
    old_deep = PrimitiveMeta(run="a", node="x", depth=3, arrival=10.0)
    old_shallow = PrimitiveMeta(run="a", node="y", depth=0, arrival=10.0)
    new_deep = PrimitiveMeta(run="b", node="x", depth=3, arrival=11.0)
    topology, objective, fifo = POLICIES["topology"], POLICIES["objective"], POLICIES["fifo"]
    ranks = [priority(topology, None, m, 99_000) for m in (old_deep, old_shallow, new_deep)]
    assert ranks == sorted(ranks) and len(set(ranks)) == 3
    # fifo: the request's own arrival, whatever its run or depth.
    assert {priority(fifo, None, m, 99_000) for m in (old_deep, old_shallow, new_deep, None)} == {99_000 * 1024}
    assert priority(fifo, None, new_deep, 5) < priority(fifo, None, old_deep, 6)
    # Under fifo a run's own topology cannot jump its deep request ahead of older requests of other runs.
    assert priority(fifo, topology, old_deep, 7) > priority(fifo, None, new_deep, 6)
    # A plain request ranks by its own arrival, as a run of one.
    assert priority(topology, None, old_deep, 0) < priority(topology, None, None, 10_500) < priority(
        topology, None, new_deep, 0)
    critical = PrimitiveMeta(run="b", node="z", depth=0, arrival=11.0, objective="latency")
    bulk = PrimitiveMeta(run="a", node="w", depth=5, arrival=10.0, objective="throughput")
    assert priority(objective, None, critical, 0) < priority(objective, None, bulk, 0)
    assert priority(topology, None, critical, 0) > priority(topology, None, bulk, 0)


def test_deadline_ranks_by_deadline_and_puts_late_runs_last():
    deadline = POLICIES["deadline"]
    # Run a arrived first but has the looser SLO; run c is already past its deadline at 12 s.
    a = PrimitiveMeta(run="a", node="x", arrival=10.0, deadline=40.0)
    b = PrimitiveMeta(run="b", node="x", arrival=11.0, deadline=20.0)
    c = PrimitiveMeta(run="c", node="x", arrival=1.0, deadline=11.0)
    ranks = {m.run: priority(deadline, None, m, 12_000) for m in (a, b, c)}
    assert ranks["b"] < ranks["a"] < ranks["c"]
    # Before c's deadline it is the most urgent of the three.
    assert priority(deadline, None, c, 10_000) < priority(deadline, None, b, 10_000)
    # No SLO, or no run: due at arrival (a chat at 12 s goes ahead of runs due later).
    assert priority(deadline, None, None, 12_000) < ranks["b"]
    assert priority(deadline, None, PrimitiveMeta(run="d", arrival=12.0), 0) < ranks["b"]
    # Within a run, the deepest node first, as topology.
    deep = PrimitiveMeta(run="b", node="y", depth=2, arrival=11.0, deadline=20.0)
    assert priority(deadline, None, deep, 12_000) < ranks["b"]


def test_deadline_counts_a_run_late_once_it_cannot_make_it_even_at_its_fastest():
    deadline = POLICIES["deadline"]
    # Both due at 40 s; at 20 s run "slow" still needs at least 25 s of its fastest run ever, "quick" 5 s.
    slow = PrimitiveMeta(run="slow", node="x", arrival=1.0, deadline=40.0, remaining=25.0)
    quick = PrimitiveMeta(run="quick", node="x", arrival=2.0, deadline=41.0, remaining=5.0)
    at_10 = {m.run: priority(deadline, None, m, 10_000) for m in (slow, quick)}
    assert at_10["slow"] < at_10["quick"]  # at 10 s both can still make it: earliest deadline first
    # Ranked again at 20 s (the same request, still waiting): slow can no longer make it and goes last,
    # behind even a run due much later.
    later = PrimitiveMeta(run="later", node="x", arrival=15.0, deadline=90.0, remaining=5.0)
    at_20 = {m.run: priority(deadline, None, m, 10_000, 20_000) for m in (slow, quick, later)}
    assert at_20["quick"] < at_20["later"] < at_20["slow"]
    # Unknown remaining work counts as none: late only past the deadline itself.
    unknown = PrimitiveMeta(run="u", node="x", arrival=1.0, deadline=40.0)
    assert priority(deadline, None, unknown, 10_000, 39_000) < at_20["later"]


@pytest.mark.anyio
async def test_admission_follows_the_rank_when_every_slot_is_taken():
    gate = PriorityGate(1)
    await gate.acquire(0)  # held
    order: list[int] = []

    async def one(rank: int) -> None:
        await gate.acquire(rank)
        order.append(rank)
        gate.release()

    async with anyio.create_task_group() as tg:
        for rank in (5, 1, 3, 1):
            tg.start_soon(one, rank)
            await anyio.wait_all_tasks_blocked()
        assert gate.waiting == 4
        gate.release()
    assert order == [1, 1, 3, 5] and gate.borrowed == 0


@pytest.mark.anyio
async def test_a_cancelled_waiter_leaves_the_queue():
    gate = PriorityGate(1)
    await gate.acquire(0)
    with anyio.move_on_after(0.05):
        await gate.acquire(1)
    assert gate.waiting == 0 and gate.borrowed == 1
    gate.release()
    assert gate.borrowed == 0


@pytest.fixture(scope="module")
def busy_llm(torch_smollm2):
    """The session's torch engine (loaded once for this module and tests/plugins) with an iteration budget of
    one queued prompt and no prefix cache, both put back after the module; every test frees what it prefilled
    (conftest's ``shared_engines_left_idle`` fails the module otherwise)."""
    portal, engine, _ = torch_smollm2
    core = engine.core
    saved, core.max_iteration_tokens = core.max_iteration_tokens, PROMPT_TOKENS
    caching = engine.prefix_caching_enabled()
    # No prefix cache: each call's prompts repeat the last call's, and must cost a full iteration each again.
    portal.call(engine.set_prefix_caching, False)
    try:
        yield portal, engine
    finally:
        portal.call(engine.set_prefix_caching, caching)  # as the session configured it
        core.max_iteration_tokens = saved


def prompt(engine, seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    """``n`` real tokens of text (distinct per seed)."""
    words = engine.encode(" ".join(f"river{seed} mill{i} wheel" for i in range(n)))
    return words[:n]


async def prefill_order(engine, policy: str, requests: list[tuple[str, PrimitiveMeta]]) -> list[str]:
    """Queue ``requests`` (in this order) behind a long prefill; the order in which the engine filled them."""
    sched = LLMScheduler(engine, max_running=64, policy=POLICIES[policy], policies=POLICIES)
    done: list[str] = []
    contexts: list[str] = []

    async def one(name: str, meta: PrimitiveMeta | None, tokens: list[int]) -> None:
        ctx = engine.new_context_id()
        contexts.append(ctx)
        await sched.prefill(ctx, tokens, meta=meta)
        done.append(name)

    async with anyio.create_task_group() as tg:
        # The blocker keeps the engine busy while the others queue together behind it.
        tg.start_soon(one, "blocker", None, prompt(engine, 0, BLOCKER_TOKENS))
        for i, (name, meta) in enumerate(requests):
            tg.start_soon(one, name, meta, prompt(engine, i + 1))
    for ctx in contexts:
        await sched.free(ctx)
    return [name for name in done if name != "blocker"]


def two_runs(override_b: str | None = None) -> list[tuple[str, PrimitiveMeta]]:
    """Runs a (older) and b, each with a shallow request (depth 0) and a deep one (depth 2), queued interleaved."""
    start = time.monotonic()

    def meta(run: str, depth: int) -> PrimitiveMeta:
        return PrimitiveMeta(run=run, node=f"{run}{depth}", depth=depth, arrival=start + (run == "b"),
                             policy=override_b if run == "b" else None)

    return [("a0", meta("a", 0)), ("b0", meta("b", 0)), ("a2", meta("a", 2)), ("b2", meta("b", 2))]


@pytest.mark.slow
def test_topology_finishes_the_older_run_first_where_fifo_interleaves(busy_llm):
    portal, engine = busy_llm
    engine.batches.clear()
    fifo = portal.call(prefill_order, engine, "fifo", two_runs())
    topology = portal.call(prefill_order, engine, "topology", two_runs())
    assert fifo == ["a0", "b0", "a2", "b2"]  # request by request: the runs interleave
    assert topology == ["a2", "a0", "b2", "b0"]  # run a first, its deepest node first
    # The engine's batch log: one queued prompt per prefill batch (the budget held), never two.
    prefill_sizes = [n for op, n in engine.batches if op == "prefill"]
    assert len(prefill_sizes) == 10 and set(prefill_sizes) == {1}


@pytest.mark.slow
def test_a_runs_own_policy_reorders_that_run_only(busy_llm):
    portal, engine = busy_llm
    # Run b asks for fifo: its shallow request (queued first) goes first; run a keeps topology's order,
    # and run a still goes before run b.
    assert portal.call(prefill_order, engine, "topology", two_runs(override_b="fifo")) == ["a2", "a0", "b0", "b2"]


@pytest.mark.slow
def test_objective_serves_latency_critical_requests_before_older_throughput_work(busy_llm):
    portal, engine = busy_llm
    start = time.monotonic()
    maps = [(f"map{i}", PrimitiveMeta(run="a", node=f"map{i}", depth=1, arrival=start, objective="throughput",
                                      task_group="map.decode@1")) for i in range(2)]
    answer = ("answer", PrimitiveMeta(run="b", node="answer", depth=0, arrival=start + 1, objective="latency"))
    requests = [*maps, answer]
    assert portal.call(prefill_order, engine, "topology", requests) == ["map0", "map1", "answer"]
    assert portal.call(prefill_order, engine, "objective", requests) == ["answer", "map0", "map1"]


@pytest.mark.slow
def test_deadline_lets_a_late_run_yield_to_one_that_can_still_make_its_slo(busy_llm):
    portal, engine = busy_llm
    now = time.monotonic()
    late = [(f"late{i}", PrimitiveMeta(run="old", node=f"n{i}", arrival=now - 30, deadline=now - 10)) for i in range(2)]
    # Not past its deadline, but its workflow never took less than a minute from this node to its end.
    doomed = ("doomed", PrimitiveMeta(run="mid", node="n", arrival=now - 20, deadline=now + 20, remaining=60.0))
    on_time = ("on_time", PrimitiveMeta(run="new", node="n", arrival=now, deadline=now + 60, remaining=5.0))
    requests = [*late, doomed, on_time]
    assert portal.call(prefill_order, engine, "topology", requests) == ["late0", "late1", "doomed", "on_time"]
    assert portal.call(prefill_order, engine, "deadline", requests) == ["on_time", "late0", "late1", "doomed"]


@pytest.mark.slow
def test_las_serves_a_one_call_program_before_an_older_long_one(busy_llm):
    """Autellix's PLAS on the real engine: an agent's turn (its program served 20,000 tokens so far) queued
    before a one-call chat is filled after it under ``las``, before it under ``fifo``."""
    portal, engine = busy_llm
    now = time.monotonic()
    requests = [("agent", PrimitiveMeta(run="agent-turn", node="n", program="key:agent", attained_tokens=20_000,
                                        arrival=now)),
                ("chat", PrimitiveMeta(run="chat", node="n", arrival=now))]
    assert portal.call(prefill_order, engine, "fifo", requests) == ["agent", "chat"]
    assert portal.call(prefill_order, engine, "las", requests) == ["chat", "agent"]


@pytest.mark.slow
def test_with_one_run_at_a_time_a_runs_decode_goes_on_and_the_next_run_in_is_the_one_still_on_time(busy_llm):
    """max_runs = 1 under deadline: run ``in`` holds a context, so its decode passes the gate at once while a
    late run and an on-time one wait; once ``in`` frees its context the on-time run is let in first."""
    portal, engine = busy_llm

    async def scenario() -> list[str]:
        sched = LLMScheduler(engine, max_running=64, max_runs=1, policy=POLICIES["deadline"], policies=POLICIES)
        now, events = time.monotonic(), []
        holder = PrimitiveMeta(run="in", node="n", arrival=now, deadline=now + 600)
        ctx = engine.new_context_id()
        await sched.prefill(ctx, prompt(engine, 0, 64), meta=holder)

        async def waiter(name: str, meta: PrimitiveMeta) -> None:
            other = engine.new_context_id()
            await sched.prefill(other, prompt(engine, 1, 64), meta=meta)
            events.append(name)
            await sched.free(other)

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter, "late", PrimitiveMeta(run="late", node="n", arrival=now - 30, deadline=now - 10))
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(waiter, "on_time", PrimitiveMeta(run="new", node="n", arrival=now, deadline=now + 60))
            await anyio.wait_all_tasks_blocked()
            assert sched.run_gate.waiting == 2
            with anyio.fail_after(120):  # the holder's decode is not held behind the waiting runs
                async for _ in sched.decode(ctx, SamplingParams(max_tokens=4, temperature=0), holder):
                    pass
            events.append("decoded")  # decode's end frees its context: the holder is out
        return events

    assert portal.call(scenario) == ["decoded", "on_time", "late"]


@pytest.mark.slow
def test_the_decode_batch_admits_the_most_urgent_rows_first(busy_llm):
    """With more decodes waiting than the batch holds, the engine lets the lower priority in first."""
    portal, engine = busy_llm

    async def go() -> list[int]:
        core = engine.core
        saved, core.max_batch_size = core.max_batch_size, 1
        first: list[int] = []
        try:
            contexts = [engine.new_context_id() for _ in range(3)]
            for i, ctx in enumerate(contexts):
                await engine.prefill(ctx, prompt(engine, 10 + i, 16))

            async def decode(ctx: str, rank: int) -> None:
                async for delta in engine.decode(ctx, SamplingParams(max_tokens=4, temperature=0), priority=rank):
                    if delta.finish_reason is not None:
                        first.append(rank)

            async with anyio.create_task_group() as tg:
                for ctx, rank in zip(contexts, (7, 3, 5)):
                    tg.start_soon(decode, ctx, rank)
            for ctx in contexts:  # engine.decode keeps its context (the scheduler's frees it)
                await engine.free(ctx)
        finally:
            core.max_batch_size = saved
        return first

    order = portal.call(go)
    # The first command batch may start any one row before the rest arrive; after that, by rank.
    assert order[1:] == sorted(order[1:]) and sorted(order) == [3, 5, 7]


class _Scores:
    """A real (tiny) LLM-shaped engine that records the priority each scoring call came with."""

    name, kind = "scores", "llm"

    def __init__(self) -> None:
        self.priorities: list[int] = []

    async def next_token_logits(self, prompts, token_ids, *, priority=0):
        import torch
        self.priorities.append(priority)
        return torch.zeros(len(prompts), len(token_ids))

    async def generate(self, tokens, params, *, priority=0):
        yield TokenDelta(text="", token_ids=[0], finish_reason="stop")


@pytest.mark.anyio
async def test_a_scoring_call_for_several_runs_ranks_as_the_most_urgent():
    engine = _Scores()
    sched = LLMScheduler(engine, max_running=4, policy=TopologyLLMPolicy())
    old = PrimitiveMeta(run="a", node="rerank", arrival=100.0)
    new = PrimitiveMeta(run="b", node="rerank", arrival=200.0)
    await sched.next_token_logits([[1, 2]], [3], [new, old])
    await sched.next_token_logits([[1, 2]], [3], [new])
    assert engine.priorities[0] == sched.priority(old, 0) < engine.priorities[1] == sched.priority(new, 0)


@pytest.mark.slow
def test_the_scheduler_sees_other_runs_requests_and_live_contexts(busy_llm):
    """What the prefill split asks before an early prefill: is anything but this run on the engine?"""
    portal, engine = busy_llm

    async def scenario() -> list[tuple[bool, bool]]:
        sched = LLMScheduler(engine, max_running=64, policy=FifoLLMPolicy())
        seen = [(sched.busy_with_other_runs("a"), sched.busy_with_other_runs("b"))]
        ctx = engine.new_context_id()
        async with anyio.create_task_group() as tg:
            tg.start_soon(sched.prefill, ctx, prompt(engine, 0, BLOCKER_TOKENS), None, PrimitiveMeta(run="a", node="n"))
            await anyio.wait_all_tasks_blocked()
            seen.append((sched.busy_with_other_runs("a"), sched.busy_with_other_runs("b")))  # a's request
        seen.append((sched.busy_with_other_runs("a"), sched.busy_with_other_runs("b")))  # a's live context
        await sched.free(ctx)
        seen.append((sched.busy_with_other_runs("a"), sched.busy_with_other_runs("b")))
        # A request from outside any run (a plain chat) is another run to every run.
        async with anyio.create_task_group() as tg:
            async def chat() -> None:
                async for _ in sched.generate(prompt(engine, 1, BLOCKER_TOKENS), SamplingParams(max_tokens=1, temperature=0)):
                    pass

            tg.start_soon(chat)
            await anyio.wait_all_tasks_blocked()
            seen.append((sched.busy_with_other_runs("a"), sched.busy_with_other_runs("b")))
        return seen

    assert portal.call(scenario) == [(False, False), (False, True), (False, True), (False, False), (True, True)]


class _CachedScores(_Scores):
    """``_Scores`` that also scores through a cache (``ScoresThroughCache``), recording each call's partition."""

    isolates_caches = scores_through_cache = True

    def __init__(self) -> None:
        super().__init__()
        self.partitions: list[str] = []

    async def next_token_logits_cached(self, prompts, token_ids, *, priority=0, cache_partition=""):
        import torch
        self.partitions.append(cache_partition)
        return torch.zeros(len(prompts), len(token_ids)), 5


class _Finished:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: None

    def finished(self, engine, seconds, prompt_tokens, generation_tokens, finish_reason, cached_tokens=0):
        self.calls.append((prompt_tokens, generation_tokens, finish_reason, cached_tokens))


@pytest.mark.anyio
async def test_scoring_through_the_cache_goes_in_the_callers_partition_and_counts_its_tokens():
    engine, observer = _CachedScores(), _Finished()
    sched = LLMScheduler(engine, max_running=4, observer=observer)
    mine = PrimitiveMeta(run="a", node="rerank", arrival=1.0, cache_partition="p" * 32)
    theirs = PrimitiveMeta(run="b", node="rerank", arrival=1.0, cache_partition="q" * 32)
    await sched.next_token_logits([[1, 2, 3], [4, 5]], [3], [mine], through_cache=True)
    await sched.next_token_logits([[1, 2]], [3], [mine])  # plain scoring: no cache, its tokens counted too
    with pytest.raises(ValueError, match="one cache partition"):
        await sched.next_token_logits([[1, 2]], [3], [mine, theirs], through_cache=True)
    assert engine.partitions == ["p" * 32] and len(engine.priorities) == 1
    assert observer.calls == [(5, 0, "stop", 5), (2, 0, "stop", 0), (2, 0, "error", 0)]
