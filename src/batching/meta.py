"""What a scheduler knows about a request: the primitive it comes from, not an anonymous call.

The graph fills a ``PrimitiveMeta`` for every engine request of a run; the
schedulers and their policies read it (Ayo's two-tier scheduling, Parrot's
performance objectives). A request from outside any run (a plain
``/v1/embeddings`` call) carries none.

A run is a program (Autellix's term: the unit whose attained service the ``las``
policy counts). An OpenAI request is a run of its own; it joins a longer program
by naming one (``prompt_cache_key``, ``user`` or the ``X-Headrace-Program`` header,
``headrace.batching.programs``), and then carries that program's id and the
tokens its earlier requests were served.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

# Parrot (OSDI '24) §5.2: a latency-critical request is served so that its own latency holds; a
# throughput one may wait in a larger batch, since only its task group's completion time matters.
Objective = Literal["latency", "throughput"]


@dataclass(frozen=True)
class PrimitiveMeta:
    """One engine request's place in its run."""

    run: str
    node: str | None = None  # None: the run's own housekeeping (dropping its table), not a primitive
    key: tuple[int, ...] = ()  # which piece of a streamed region this instance serves
    depth: int = 0  # Ayo Algorithm 2: hops to the graph's sinks, as ``Graph.compute_depths`` counts them
    task_group: str | None = None  # the parallel primitives of one stage share it (unique within the run)
    objective: Objective = "latency"
    prefix_hash: str | None = None  # the prompt's static prefix (Parrot's PrefixHash); LLM prefills only
    arrival: float = field(default_factory=time.monotonic)  # the run's, on the ``time.monotonic`` clock
    deadline: float | None = None  # arrival + the run's SLO, same clock; None: no SLO
    # The least time from this primitive's start to its run's end (the fastest run of its workflow so
    # far, ``graph.remaining``): a run that cannot make its deadline even then is late already. None: unknown.
    remaining: float | None = None
    policy: str | None = None  # the run's batch policy override; None: the engine's own
    # The program the run belongs to across runs (an OpenAI request naming one); None: the run is its program.
    program: str | None = None
    # Tokens the engine computed for the program's earlier requests (before this run): prompt tokens less
    # prefix-cache hits, plus generated. Its attained service, which ``las`` ranks by (least first). 0 for a program's first request and for a workflow run.
    attained_tokens: int = 0
    # Which cached KV the request may reuse and adds to (issue 50): an opaque digest of its API key (where keys
    # are kept apart) and its ``cache_salt``; "" the shared partition. The LLM scheduler hands it to an engine
    # that ``IsolatesCaches``.
    cache_partition: str = ""

    @property
    def program_id(self) -> str:
        """The program this request belongs to: the named one, else its run."""
        return self.program if self.program is not None else self.run
