"""The engine thread's results, handed to the event loop in order, waking it without giving up the GIL.

``loop.call_soon_threadsafe`` wakes the loop by a ``send`` on its self-pipe, which releases the GIL: the
woken loop takes it and runs everything it has ready (the streams' deltas, the SSE writes) while the
engine thread waits to get it back, so that work ran between two decodes of every step, serialised with
them. Here the engine thread writes the wake-up byte through ctypes' ``PyDLL``, which keeps the GIL, and
carries on to its next ``llama_decode`` (on a decode step nothing between releases the GIL); the loop runs
its share while that decode, which releases the GIL, computes. (Waking the loop only right before that
decode measured the same, issue 51, AMD EPYC, so the simpler hand-off stayed.)

One byte per wake-up at most: the thread writes only when the loop has not been woken since its last
drain, so a busy loop is not woken once per step.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import os
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


def _gil_holding_write() -> Callable[[int], None]:
    """A one-byte ``write(2)`` that keeps the GIL (libc through ``PyDLL``); ``os.write`` where there is none."""
    try:
        write = ctypes.PyDLL(None).write
    except (AttributeError, OSError):
        return lambda fd: _plain_write(fd)
    write.argtypes, write.restype = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t), ctypes.c_ssize_t
    return lambda fd: write(fd, b"\0", 1)  # a full pipe (EAGAIN) is fine: the loop is due to wake anyway


def _plain_write(fd: int) -> None:
    try:
        os.write(fd, b"\0")
    except BlockingIOError:
        pass


_write_byte = _gil_holding_write()


class LoopInbox(Generic[T]):
    """Items ``put`` by one thread, given to ``deliver`` on ``loop`` in the order they were put."""

    def __init__(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[T], None]) -> None:
        self._loop, self._deliver = loop, deliver
        self._items: collections.deque[T] = collections.deque()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._woken = False  # a byte is on its way since the last drain
        self._open = True
        loop.add_reader(self._read_fd, self.drain)

    def put(self, item: T) -> bool:
        """From the producing thread; False once the inbox is closed (nothing will deliver it)."""
        if not self._open:
            return False
        self._items.append(item)
        if not self._woken:
            self._woken = True
            _write_byte(self._write_fd)
        return True

    def drain(self) -> None:
        """On the loop: deliver everything put so far."""
        try:
            os.read(self._read_fd, 4096)
        except (BlockingIOError, OSError):
            pass
        # Cleared before taking items: an item put after this point either is taken below or wakes the loop again.
        self._woken = False
        while self._items:
            self._deliver(self._items.popleft())

    def close(self) -> None:
        """On the loop, once the producer has stopped: deliver what is left and stop listening."""
        if not self._open:
            return
        self._open = False
        self._loop.remove_reader(self._read_fd)
        self.drain()
        os.close(self._read_fd)
        os.close(self._write_fd)
