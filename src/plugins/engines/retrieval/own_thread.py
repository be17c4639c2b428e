"""Torch work on a thread of its own that ends with the work, so the OpenMP pool it makes ends too.

torch and llama.cpp's CPU backend share one libgomp in this process (torch loads it first), and libgomp keeps a
pool of OpenMP workers for every thread that ran a parallel region, until that thread ends. Once it manages more
threads than there are CPUs, every waiter spins 1,000 rounds instead of ``GOMP_SPINCOUNT`` before it sleeps, and
each of a llama.cpp decode's few hundred barriers becomes a futex sleep and wake. One embeddings request on an
anyio worker thread (which lingers 10 s idle, its pool with it) took the next 400-token stream of the default
daemon from 316k futex calls to 594k (Xeon, 2 cores; docs/engines.md). A thread that ends with its batch gives
its pool back at once; a thread started and joined costs about 70 us here, its new OpenMP team a little more.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

import anyio

T = TypeVar("T")


async def run_in_own_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a new thread that ends once it returns (not cancellable, as ``to_thread.run_sync``)."""
    return await anyio.to_thread.run_sync(_run_and_end, fn, args)


def _run_and_end(fn: Callable[..., T], args: tuple[Any, ...]) -> T:
    # A one-worker pool: its thread ends when the pool shuts down, which ``with`` waits for.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="headrace-torch-batch") as pool:
        return pool.submit(fn, *args).result()
