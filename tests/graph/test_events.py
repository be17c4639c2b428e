"""A run's event log: readers at their own pace, explicit drops, the end always delivered, memory released."""

from __future__ import annotations

import anyio
import pytest

from headrace.graph.events import RunEvents

pytestmark = pytest.mark.anyio


def node(i: int) -> dict:
    return {"event": "node.finished", "node": f"n{i}"}


async def read_all(reader) -> list:
    async with reader:
        return [e async for e in reader]


async def test_a_reader_gets_every_event_in_order_with_contiguous_ids_and_ends_at_the_final_one():
    log = RunEvents(capacity=16)
    reader = log.follow()
    got = []

    async def consume():
        got.extend(await read_all(reader))

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        for i in range(5):
            log.publish(node(i))
            await anyio.sleep(0)
        log.publish({"event": "run.finished", "result": 1})
    assert [e.seq for e in got] == list(range(6))
    assert [e.name for e in got] == ["node.finished"] * 5 + ["run.finished"]
    assert all("time" in e.body for e in got)


async def test_publishing_never_waits_and_a_reader_that_fell_behind_is_told_what_it_missed():
    log = RunEvents(capacity=4)
    reader = log.follow()  # attached, but reads nothing while the run publishes
    for i in range(10):
        log.publish(node(i))  # would block or raise here if publishing waited for the reader
    log.publish({"event": "run.finished"})
    got = await read_all(reader)
    assert got[0].name == "events.dropped" and got[0].seq == -1
    assert got[0].body["missed"] == 7 and got[0].body["resume"] == 7
    assert [e.seq for e in got[1:]] == [7, 8, 9, 10]
    assert got[-1].name == "run.finished"  # the end is always held
    assert log.dropped == 7


async def test_two_readers_keep_their_own_pace():
    log = RunEvents(capacity=8)
    fast, slow = log.follow(), log.follow()
    for i in range(3):
        log.publish(node(i))
    first = [await fast.__anext__() for _ in range(3)]
    assert [e.seq for e in first] == [0, 1, 2]
    log.publish({"event": "run.failed", "status": "cancelled"})
    assert [e.seq for e in await read_all(fast)] == [3]
    assert [e.seq for e in await read_all(slow)] == [0, 1, 2, 3]


async def test_after_resumes_behind_the_given_id_as_a_reconnecting_event_source_does():
    log = RunEvents()
    for i in range(5):
        log.publish(node(i))
    reader = log.follow(after=2)
    log.publish({"event": "run.finished"})
    assert [e.seq for e in await read_all(reader)] == [3, 4, 5]


async def test_a_finished_unread_log_keeps_only_its_last_event_but_an_attached_reader_keeps_it_all():
    held = RunEvents()
    reader = held.follow()
    for i in range(50):
        held.publish(node(i))
    held.publish({"event": "run.finished"})
    assert len(await read_all(reader)) == 51  # held for the reader attached before the end

    unread = RunEvents()
    for i in range(50):
        unread.publish(node(i))
    unread.publish({"event": "run.finished"})
    late = await read_all(unread.follow())  # from the oldest held: the end
    assert [(e.name, e.seq) for e in late] == [("run.finished", 50)]
    from_start = await read_all(unread.follow(after=-1))  # from the very first: told what is gone
    assert [e.name for e in from_start] == ["events.dropped", "run.finished"]
    assert from_start[0].body["missed"] == 50

    # the held log, once its reader is gone, is released the same way
    again = await read_all(held.follow(after=-1))
    assert [e.name for e in again] == ["events.dropped", "run.finished"]


async def test_nothing_is_published_after_the_final_event():
    log = RunEvents()
    log.publish({"event": "run.finished"})
    log.publish(node(99))  # a straggler
    assert [e.name for e in await read_all(log.follow())] == ["run.finished"]


async def test_a_closed_reader_stops_and_a_blocked_one_wakes_on_close():
    log = RunEvents()
    reader = log.follow()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            got = []

            async def consume():
                got.extend(await read_all(reader))

            tg.start_soon(consume)
            await anyio.sleep(0.01)
            log.close()
    assert got == []
