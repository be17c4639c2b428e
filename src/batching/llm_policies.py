"""Built-in LLM scheduling policies (a plugin: registered through ``register_llm_policies``).

An LLM engine batches continuously, so a policy does not form batches: it ranks
requests. The LLM scheduler turns each request's rank into the engine's integer
``priority`` (lower runs first, ties in arrival order, as vLLM's priority
scheduling), and admits waiting requests in the same order when ``max_running``
is reached. Each engine iteration then takes the most urgent prefills, scoring
prompts and joining decodes its token budget holds.

A rank has two parts. ``run_rank`` orders runs against each other (and plain
requests, which belong to no run); ``node_rank`` orders one run's own requests
among themselves. A run that names its own policy (``PrimitiveMeta.policy``)
gets its ``node_rank`` from that policy and its ``run_rank`` from the engine's,
so an override reorders that run's requests and no one else's.

A policy whose ``preempts`` is true (``las``) also lets its ranks preempt: the scheduler sends its
requests ``preemptive`` to an engine that can pause decodes (``PausesDecodes``), where a request that
cannot get into the batch pauses running decodes of a lower rank (KV kept) until it has got in
(``headrace.plugins.engines.llm.preemption``). Without it (every other built-in) a running decode is never
paused: a rank only orders what joins the batch next.
"""

from __future__ import annotations

from typing import Protocol

from headrace.batching.meta import PrimitiveMeta
from headrace.plugins.hookspecs import hookimpl

# node_rank is in [0, NODE_RANKS): the run_rank is scaled past it.
NODE_RANKS = 1024
# Objective classes are this far apart: past any run arrival in milliseconds (about 285 years).
CLASS_SPAN = 1 << 43


class LLMPolicy(Protocol):
    name: str
    # Optional (False when absent): the policy's ranks may pause running decodes of a lower rank.
    preempts: bool

    def run_rank(self, meta: PrimitiveMeta | None, arrival_ms: int, now_ms: int) -> int:
        """Where the request's run stands against other runs (lower first). ``arrival_ms``: the request's own
        arrival, in milliseconds on the scheduler's clock; ``meta.arrival`` is the run's, in seconds;
        ``now_ms``: when it is ranked (a waiting request is ranked again as places free up)."""
        ...

    def node_rank(self, meta: PrimitiveMeta | None) -> int:
        """Where the request stands within its run, in [0, NODE_RANKS) (lower first)."""
        ...


class FifoLLMPolicy:
    """Request-level, what a plain server does: every request is a run of its own, ranked by its own
    arrival, so the engine serves them first come first served and every run's requests interleave
    with everyone else's. The baseline. (A run's own policy can then only order its requests that
    arrive in the same millisecond: under FIFO there is no run to reorder within.)"""

    name = "fifo"
    preempts = False

    def run_rank(self, meta: PrimitiveMeta | None, arrival_ms: int, now_ms: int) -> int:
        return arrival_ms

    def node_rank(self, meta: PrimitiveMeta | None) -> int:
        return 0


class TopologyLLMPolicy:
    """Ayo (ASPLOS '25) §5.2 applied to the LLM: the earliest-arrived run first, and within a run the
    deepest node first (``meta.depth``: the most downstream work waits on it). Runs finish one after the
    other instead of all advancing slowly together, which is what keeps the oldest within their SLO.
    A request from no run ranks by its own arrival, as a run of one."""

    name = "topology"
    preempts = False

    def run_rank(self, meta: PrimitiveMeta | None, arrival_ms: int, now_ms: int) -> int:
        return arrival_ms if meta is None else meta_arrival_ms(meta)

    def node_rank(self, meta: PrimitiveMeta | None) -> int:
        depth = 0 if meta is None else meta.depth
        return NODE_RANKS - 1 - min(max(depth, 0), NODE_RANKS - 1)


class ObjectiveLLMPolicy(TopologyLLMPolicy):
    """Parrot (OSDI '24) §5.2: the latency-critical requests the graph deduced (those producing a run's
    output, and the calls right before them) ahead of every throughput request; then by run arrival,
    so a task group (parallel requests of one stage, which share the run and the depth) ranks as one
    and is served together, filling the engine's batch. Plain requests are latency-critical."""

    name = "objective"

    def run_rank(self, meta: PrimitiveMeta | None, arrival_ms: int, now_ms: int) -> int:
        throughput = meta is not None and meta.objective == "throughput"
        return int(throughput) * CLASS_SPAN + super().run_rank(meta, arrival_ms, now_ms)


class DeadlineLLMPolicy(TopologyLLMPolicy):
    """Goodput under overload: earliest deadline first over runs (``meta.deadline``, the run's SLO), and a
    late run behind every run that can still make it. Under ``topology`` the oldest run goes first even
    when it is already late, so in overload every run it delays turns late too; here a late run yields
    to the runs that still count toward goodput, and still finishes, oldest first, in the capacity they
    leave. A run is late once it cannot make its deadline even at its fastest: now plus the least time
    its workflow ever took from this primitive to its end (``meta.remaining``) is past the deadline.
    The rank depends on the time, so a waiting request is ranked again before it is let in. Within a
    run, deepest node first (as ``topology``). A request with no deadline (no SLO, or no run) is due at
    its arrival: a plain chat goes ahead of runs that have time."""

    name = "deadline"

    def run_rank(self, meta: PrimitiveMeta | None, arrival_ms: int, now_ms: int) -> int:
        if meta is None or meta.deadline is None:
            return super().run_rank(meta, arrival_ms, now_ms)
        deadline_ms = int(meta.deadline * 1000)
        late = now_ms + int((meta.remaining or 0.0) * 1000) > deadline_ms
        return int(late) * CLASS_SPAN + deadline_ms


class LasLLMPolicy(TopologyLLMPolicy):
    """Autellix (PLAS, program-level least attained service): the request whose program has been served
    the least so far goes first, so a one-call chat is not queued behind a twelve-step agent. A program
    is a workflow run, or the OpenAI requests that name one (``prompt_cache_key``, ``user``, the
    ``X-Headrace-Program`` header); its attained service is ``meta.attained_tokens``, the tokens the
    engine computed for its earlier requests (prompt tokens less prefix-cache hits, plus generated: a
    client agent's resent history is not service again), to which the LLM scheduler adds what the run itself was
    served so far on the engine (a workflow run's or a session's earlier calls). A one-call request
    naming no program has 0.

    Aging, so nothing starves: each token of attained service counts as ``ms_per_token`` milliseconds
    of lateness, and the rank is the request's own arrival plus that handicap (at most
    ``max_handicap_ms``). Ordered at any instant, that is attained service scaled minus time waited:
    ``rank - now = attained_tokens * ms_per_token - waiting_ms``. A request of a long program is
    overtaken only by requests arriving within its handicap after it, so it waits at most that long
    behind newcomers; among equal ranks the earlier arrival goes first. Within a run, deepest node
    first (as ``topology``).

    Preemption (``preempts``): where the engine can pause decodes (the llama.cpp core), a request that
    cannot get into the engine's batch because running decodes of a lower rank fill it (a decode waiting
    for a row slot, a prefill wanting the tokens the rows take) pauses the least urgent of them. A paused
    decode keeps its KV, pending token and sampler state and resumes, unchanged, as soon as the more
    urgent work has got in; its output is the same as unpaused. Pauses are bounded twice: by the aging
    above (only requests arriving within a row's handicap after it outrank it, so what can pause it is
    finite), and by the engine, which resumes a decode paused for ``preempt_max_pause_seconds`` in all
    (10 s) ahead of all other preemptive work and never pauses it again."""

    name = "las"
    ranks_by_attained = True  # the scheduler adds the run's own service here to ``meta.attained_tokens``
    preempts = True  # its ranks may pause running decodes of a lower rank (see above)
    ms_per_token = 1.0  # 1,000 attained tokens weigh as much as one second of waiting
    max_handicap_ms = 600_000  # ten minutes: the longest a program's history can hold a request back

    def run_rank(self, meta: PrimitiveMeta | None, arrival_ms: int, now_ms: int) -> int:
        attained = 0 if meta is None else max(0, meta.attained_tokens)
        return arrival_ms + min(int(attained * self.ms_per_token), self.max_handicap_ms)


# The scheduler's clock starts at the monotonic clock's zero: ranks of different schedulers agree.
def meta_arrival_ms(meta: PrimitiveMeta) -> int:
    return int(meta.arrival * 1000)


def priority(engine_policy: LLMPolicy, run_policy: LLMPolicy | None, meta: PrimitiveMeta | None,
             arrival_ms: int, now_ms: int | None = None) -> int:
    """The engine priority of one request, ranked at ``now_ms`` (default: its arrival): the engine's policy
    ranks its run, the run's own policy (if it names one) its place within the run."""
    within = (run_policy or engine_policy).node_rank(meta)
    now = arrival_ms if now_ms is None else now_ms
    return engine_policy.run_rank(meta, arrival_ms, now) * NODE_RANKS + within


@hookimpl
def register_llm_policies(register):
    register("fifo", FifoLLMPolicy)
    register("topology", TopologyLLMPolicy)
    register("objective", ObjectiveLLMPolicy)
    register("deadline", DeadlineLLMPolicy)
    register("las", LasLLMPolicy)
