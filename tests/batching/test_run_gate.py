"""Run admission: at most ``limit`` runs in, waiters let in by rank, a run that is in never waits."""

from __future__ import annotations

import anyio
import pytest

from headrace.batching.run_gate import RunGate

pytestmark = pytest.mark.anyio


async def test_no_bound_lets_everyone_in():
    gate = RunGate(0)
    for run in "abcdef":
        await gate.enter({run}, 0)
    assert gate.inside == 6 and gate.waiting == 0


async def test_the_bound_holds_and_waiters_come_in_most_urgent_first():
    gate = RunGate(2)
    await gate.enter({"a"}, 10)
    await gate.enter({"b"}, 10)
    order: list[str] = []

    async def one(run: str, rank: int) -> None:
        held = await gate.enter({run}, rank)
        order.append(run)
        assert gate.inside <= 2
        await anyio.sleep(0.01)
        gate.leave(held)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            for run, rank in (("late", 90), ("soon", 1), ("later", 50)):
                tg.start_soon(one, run, rank)
                await anyio.wait_all_tasks_blocked()
            assert gate.waiting == 3 and order == []
            gate.leave({"a"})
            await anyio.wait_all_tasks_blocked()
            assert order == ["soon"]
            gate.leave({"b"})
    assert order == ["soon", "later", "late"] and gate.inside == 0


async def test_a_run_that_is_in_passes_even_when_the_gate_is_full_and_others_wait():
    gate = RunGate(1)
    await gate.enter({"a"}, 5)
    gate.hold("a")  # a live context of a's
    async with anyio.create_task_group() as tg:
        tg.start_soon(gate.enter, {"b"}, 0)  # more urgent, but a is in
        await anyio.wait_all_tasks_blocked()
        with anyio.fail_after(1):
            held = await gate.enter({"a"}, 99)  # a's decode: passes at once
        gate.leave(held)
        gate.leave({"a"})  # the first request ends; the context still holds a
        await anyio.wait_all_tasks_blocked()
        assert gate.waiting == 1 and gate.is_in("a") and not gate.is_in("b")
        gate.leave({"a"})  # the context is freed: a is out, b comes in
        await anyio.wait_all_tasks_blocked()
        assert gate.is_in("b") and gate.waiting == 0


async def test_a_cancelled_waiter_leaves_no_trace_and_raising_the_bound_lets_waiters_in():
    gate = RunGate(1)
    await gate.enter({"a"}, 0)
    with anyio.move_on_after(0.05):
        await gate.enter({"b"}, 0)
    assert gate.waiting == 0 and not gate.is_in("b")
    async with anyio.create_task_group() as tg:
        tg.start_soon(gate.enter, {"c"}, 0)
        await anyio.wait_all_tasks_blocked()
        gate.limit = 2
        await anyio.wait_all_tasks_blocked()
        assert gate.is_in("c") and gate.inside == 2


async def test_a_request_of_several_runs_passes_if_one_is_in_and_requests_of_no_run_never_wait():
    gate = RunGate(1)
    await gate.enter({"a"}, 0)
    with anyio.fail_after(1):
        held = await gate.enter({"a", "b"}, 0)  # a rerank batch of a's and b's
        assert held == {"a", "b"} and gate.inside == 2  # past the bound rather than split the batch
        gate.leave(held)
        assert await gate.enter({None}, 0) == frozenset()
    assert gate.inside == 1


async def test_waiters_are_ranked_again_when_a_place_frees_up():
    gate = RunGate(1)
    await gate.enter({"a"}, 0)
    ranks = {"first": 1, "second": 2}
    order: list[str] = []

    async def one(run: str) -> None:
        held = await gate.enter({run}, ranks[run], rerank=lambda: ranks[run])
        order.append(run)
        gate.leave(held)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            for run in ("first", "second"):
                tg.start_soon(one, run)
                await anyio.wait_all_tasks_blocked()
            ranks["first"] = 3  # while waiting, "first" turned late (a policy's rank changed with time)
            gate.leave({"a"})
    assert order == ["second", "first"]
