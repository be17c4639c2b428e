"""Built-in batch policies (a plugin: registered through ``register_batch_policies``).

A policy picks which queued requests form the next batch. The scheduler hands it
the queue in arrival order and the batch's capacity in items.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from headrace.batching.queue import Pending
from headrace.plugins.hookspecs import hookimpl


class BatchPolicy(Protocol):
    name: str

    def select(self, queue: Sequence[Pending], capacity: int) -> list[Pending]:
        """The requests to run next; never empty when the queue is not."""
        ...


class FifoPolicy:
    """Blind request-level batching, as a plain server does: oldest first until full.

    A request larger than the whole capacity still runs, alone, rather than starve.
    """

    name = "fifo"

    def select(self, queue: Sequence[Pending], capacity: int) -> list[Pending]:
        batch: list[Pending] = []
        used = 0
        for item in queue:
            if batch and used + item.size > capacity:
                break
            batch.append(item)
            used += item.size
        return batch


@hookimpl
def register_batch_policies(register):
    register("fifo", FifoPolicy)
