"""Programs across requests (issue 28 items 1-2): which program a request joins, the service it attained,
and the ``las`` policy that ranks by it (least attained service first, with aging)."""

from __future__ import annotations

from contextlib import aclosing

import pytest

from headrace.batching.llm import LLMScheduler
from headrace.batching.llm_policies import (
    NODE_RANKS,
    DeadlineLLMPolicy,
    FifoLLMPolicy,
    LasLLMPolicy,
    ObjectiveLLMPolicy,
    TopologyLLMPolicy,
    priority,
)
from headrace.batching.meta import PrimitiveMeta
from headrace.batching.programs import MAX_PROGRAM_ID, ProgramRegistry, program_of
from headrace.plugins.protocols import SamplingParams, TokenDelta


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_registry_accumulates_per_program():
    reg = ProgramRegistry(clock=Clock())
    assert reg.attained("a") == 0 and reg.attained(None) == 0
    assert reg.add("a", 120) == 120
    assert reg.add("a", 30) == 150
    reg.add("b", 7)
    reg.add(None, 1_000)  # a program of one call is not kept
    assert (reg.attained("a"), reg.attained("b"), len(reg)) == (150, 7, 2)


def test_an_idle_program_expires_and_activity_keeps_it():
    clock = Clock()
    reg = ProgramRegistry(idle_seconds=10.0, clock=clock)
    reg.add("a", 100)
    reg.add("b", 100)
    clock.now += 8
    assert reg.attained("a") == 100  # a request starting is activity: a's idle time starts again
    clock.now += 5  # b idle 13 s, a 5 s
    assert (reg.attained("a"), reg.attained("b"), len(reg)) == (100, 0, 1)
    clock.now += 10
    assert reg.attained("a") == 0 and len(reg) == 0
    assert reg.add("a", 5) == 5  # starts again from zero


def test_the_registry_is_bounded_least_recently_active_first():
    reg = ProgramRegistry(capacity=2, clock=Clock())
    reg.add("a", 1)
    reg.add("b", 2)
    reg.attained("a")  # a active again: b is now the least recent
    reg.add("c", 3)
    assert (reg.attained("a"), reg.attained("b"), reg.attained("c"), len(reg)) == (1, 0, 3, 2)
    with pytest.raises(ValueError):
        ProgramRegistry(capacity=0)


def test_program_precedence_key_then_user_then_header():
    assert program_of("conv-1", "alice", "hdr") == "key:conv-1"
    assert program_of(None, "alice", "hdr") == "user:alice"
    assert program_of("", "alice", "hdr") == "user:alice"  # empty names nothing
    assert program_of(None, None, "hdr") == "header:hdr"
    assert program_of(None, "", None) is None and program_of(None, None, None) is None
    # The sources are kept apart, and so are API keys.
    assert program_of("x", None, None) != program_of(None, "x", None) != program_of(None, None, "x")
    assert program_of("x", None, None, "k1") != program_of("x", None, None, "k2")
    # A very long id is kept as its digest: the same id, the same program, bounded memory.
    long = "z" * (MAX_PROGRAM_ID + 1)
    assert program_of(long, None, None) == program_of(long, None, None)
    assert len(program_of(long, None, None)) < MAX_PROGRAM_ID


def meta(run: str, attained: int = 0, program: str | None = None, arrival: float = 0.0) -> PrimitiveMeta:
    return PrimitiveMeta(run=run, node="n", program=program, attained_tokens=attained, arrival=arrival)


def test_las_serves_the_program_with_less_attained_service_first():
    las = LasLLMPolicy()
    long_agent = meta("r1", attained=5_000, program="key:agent")
    chat = meta("r2", attained=0)
    # The agent's turn arrived first (t = 10 s), the chat a second later: the chat still goes first.
    assert priority(las, None, chat, 11_000) < priority(las, None, long_agent, 10_000)
    # Same attained service: ties by arrival (a lower rank for the earlier one).
    assert priority(las, None, meta("a", 300), 10_000) < priority(las, None, meta("b", 300), 10_001)
    # No meta (a request from no run) has attained nothing.
    assert priority(las, None, None, 10_500) == priority(las, None, meta("c"), 10_500)


def test_las_ages_an_old_request_past_newcomers():
    """Aging: a long program's request waits behind newcomers only for its handicap, then overtakes them."""
    las = LasLLMPolicy()
    old = meta("r1", attained=2_000, program="key:agent")  # a 2 s handicap at 1 ms per token
    rank_old = priority(las, None, old, 10_000, now_ms=10_000)
    assert priority(las, None, meta("n1"), 11_000) < rank_old  # a new one-call program a second later: first
    assert priority(las, None, meta("n2"), 12_500) > rank_old  # one arriving past the handicap: after it
    # A waiting request is re-ranked as places free up: its rank does not grow with the time it waits.
    assert priority(las, None, old, 10_000, now_ms=60_000) == rank_old
    # The handicap is bounded: even a huge program waits at most max_handicap_ms behind newcomers.
    huge = meta("r3", attained=10**12)
    assert priority(las, None, huge, 0) == las.max_handicap_ms * NODE_RANKS + priority(las, None, meta("r4"), 0)
    assert priority(las, None, meta("n3"), las.max_handicap_ms + 1) > priority(las, None, huge, 0)


@pytest.mark.parametrize("policy", [FifoLLMPolicy(), TopologyLLMPolicy(), ObjectiveLLMPolicy(), DeadlineLLMPolicy()])
def test_the_other_policies_ignore_programs(policy):
    """A program and its attained service change no rank of fifo, topology, objective or deadline."""
    plain = PrimitiveMeta(run="r", node="n", depth=2, arrival=3.0, deadline=9.0, remaining=1.0)
    named = PrimitiveMeta(run="r", node="n", depth=2, arrival=3.0, deadline=9.0, remaining=1.0,
                          program="key:agent", attained_tokens=123_456)
    for arrival, now in ((3_000, None), (4_000, 8_500), (5_000, 20_000)):
        assert priority(policy, None, named, arrival, now) == priority(policy, None, plain, arrival, now)
    if isinstance(policy, FifoLLMPolicy):
        assert priority(policy, None, named, 4_000) == 4_000 * NODE_RANKS


def test_a_program_id_is_the_named_one_else_the_run():
    assert PrimitiveMeta(run="r").program_id == "r"
    assert PrimitiveMeta(run="r", program="key:p").program_id == "key:p"
    assert PrimitiveMeta(run="r").attained_tokens == 0


class _Tokens:
    """An LLM-shaped engine that records each request's priority and generates three tokens."""

    name, kind = "tokens", "llm"

    def __init__(self) -> None:
        self.priorities: list[int] = []

    async def generate(self, tokens, params, *, priority=0):
        self.priorities.append(priority)
        for i in range(3):
            yield TokenDelta(text="x", token_ids=[i], finish_reason="stop" if i == 2 else None)


async def _generate(sched: LLMScheduler, tokens: int, meta: PrimitiveMeta) -> None:
    async with aclosing(sched.generate(list(range(tokens)), SamplingParams(max_tokens=3), meta)) as deltas:
        async for _ in deltas:
            pass


@pytest.mark.anyio
async def test_the_scheduler_adds_a_runs_own_earlier_service_under_las():
    """A workflow run (or a session) is a program: under ``las`` its later calls rank by what its earlier
    calls were served on the engine, on top of its named program's earlier requests."""
    engine = _Tokens()
    sched = LLMScheduler(engine, max_running=4, policy=LasLLMPolicy())
    first = PrimitiveMeta(run="wf", node="a", arrival=1.0)
    await _generate(sched, 10, first)
    assert sched.served.attained("wf") == 13  # 10 prompt + 3 generated
    fresh = PrimitiveMeta(run="other", node="a", arrival=1.0)
    assert sched.priority(first, 5.0) == sched.priority(fresh, 5.0) + 13 * NODE_RANKS
    named = PrimitiveMeta(run="wf", node="b", program="key:p", attained_tokens=100, arrival=1.0)
    assert sched.priority(named, 5.0) == sched.priority(fresh, 5.0) + 113 * NODE_RANKS
    # The engine got the rank too: the run's second call ranks behind a fresh run's at the same time.
    await _generate(sched, 1, first)
    assert engine.priorities[1] > sched.priority(fresh, 0.0)


@pytest.mark.anyio
async def test_fifo_ranks_do_not_see_the_served_count():
    engine = _Tokens()
    sched = LLMScheduler(engine, max_running=4, policy=FifoLLMPolicy())
    meta = PrimitiveMeta(run="wf", node="a", program="key:p", attained_tokens=9_999, arrival=1.0)
    await _generate(sched, 10, meta)
    assert sched.priority(meta, 5.0) == 5_000 * NODE_RANKS == sched.priority(None, 5.0)


class _PausingTokens(_Tokens):
    """As ``_Tokens``, for an engine that can pause decodes: records the keywords each request came with."""

    pauses_decodes = True

    def __init__(self) -> None:
        super().__init__()
        self.keywords: list[dict] = []

    async def generate(self, tokens, params, *, priority=0, **keywords):
        self.keywords.append(keywords)
        async for delta in super().generate(tokens, params, priority=priority):
            yield delta


@pytest.mark.anyio
async def test_only_a_preempting_policy_sends_requests_preemptive_and_only_to_an_engine_that_pauses():
    """``las`` preempts; ``fifo`` (and every other built-in) does not, so its requests go as before. An engine
    that cannot pause decodes (``_Tokens`` takes no such keyword) is never sent the flag."""
    assert LasLLMPolicy.preempts and not any(p.preempts for p in (FifoLLMPolicy(), TopologyLLMPolicy(),
                                                                   ObjectiveLLMPolicy(), DeadlineLLMPolicy()))
    meta = PrimitiveMeta(run="wf", node="a", arrival=1.0)
    pausing = _PausingTokens()
    await _generate(LLMScheduler(pausing, max_running=4, policy=LasLLMPolicy()), 4, meta)
    await _generate(LLMScheduler(pausing, max_running=4, policy=FifoLLMPolicy()), 4, meta)
    assert pausing.keywords == [{"preemptive": True}, {}]
    plain = _Tokens()
    await _generate(LLMScheduler(plain, max_running=4, policy=LasLLMPolicy()), 4, meta)
    assert len(plain.priorities) == 1
