"""LoopInbox: the engine thread's outboxes reach the event loop in order, one wake-up for all that were put
before the loop ran, and none is lost when the inbox closes."""

from __future__ import annotations

import asyncio
import threading

from headrace.plugins.engines.llm.inbox import LoopInbox


def test_items_put_before_the_loop_runs_arrive_in_order_in_one_drain():
    async def main():
        got, drains = [], []
        inbox = LoopInbox(asyncio.get_running_loop(), got.append)
        real_drain = inbox.drain
        inbox.drain = lambda: (drains.append(len(got)), real_drain())  # the reader was registered with the bound drain
        asyncio.get_running_loop().remove_reader(inbox._read_fd)
        asyncio.get_running_loop().add_reader(inbox._read_fd, inbox.drain)
        for i in range(100):  # no await between: the loop cannot run until all are in
            assert inbox.put(i)
        await asyncio.sleep(0.05)
        assert got == list(range(100))
        assert drains == [0]  # one byte written for the hundred, so one wake-up
        assert inbox.put(100)  # woken again once drained
        await asyncio.sleep(0.05)
        assert got == list(range(101)) and drains == [0, 100]
        inbox.close()

    asyncio.run(main())


def test_a_thread_put_stream_arrives_whole_and_in_order():
    async def main():
        got = []
        loop = asyncio.get_running_loop()
        inbox = LoopInbox(loop, got.append)

        def produce():
            for i in range(5000):
                inbox.put(i)

        await asyncio.to_thread(produce)
        for _ in range(100):
            if len(got) == 5000:
                break
            await asyncio.sleep(0.01)
        assert got == list(range(5000))
        inbox.close()

    asyncio.run(main())


def test_close_delivers_what_is_left_and_refuses_more():
    async def main():
        got = []
        inbox = LoopInbox(asyncio.get_running_loop(), got.append)
        done = threading.Event()
        threading.Thread(target=lambda: ([inbox.put(i) for i in range(10)], done.set())).start()
        done.wait(5)
        inbox.close()  # before the loop ran the reader: close drains
        assert got == list(range(10))
        assert inbox.put(10) is False
        await asyncio.sleep(0.01)
        assert got == list(range(10))
        inbox.close()  # twice is harmless

    asyncio.run(main())
