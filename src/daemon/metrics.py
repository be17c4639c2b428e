"""Prometheus metrics: the vLLM request set under a ``headrace_`` prefix, plus batch sizes and workflow runs.

A vLLM metric ``vllm:<name>`` is ``headrace_<name>`` here, with the same type, unit and meaning, and a
``model`` label where vLLM has ``model_name`` (the README's metrics table maps each). Each app owns
its own registry, so several apps (tests) never collide.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from headrace.daemon.heap import HeapUsage

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256)
# vLLM's 1-2-5 series for tokens per request (it stops at the model's context; ours is a fixed ceiling).
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
RUN_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
ACTIVITY_KEEP = 100_000  # engine batches remembered for run timelines (a decode step is one)


@dataclass(frozen=True, slots=True)  # 100,000 kept: a quarter less memory without a dict each
class Busy:
    """One batch an engine computed, in ``time.monotonic()`` seconds."""

    engine: str
    op: str
    size: int
    start: float
    end: float

    def to_json(self, origin: float) -> dict[str, Any]:
        return {"engine": self.engine, "op": self.op, "size": self.size,
                "start": round(self.start - origin, 6), "end": round(self.end - origin, 6)}


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "headrace_time_to_first_token_seconds", "Time to first token.", ["model"], registry=r, buckets=LATENCY_BUCKETS
        )
        self.itl = Histogram(
            "headrace_inter_token_latency_seconds", "Time between output tokens.", ["model"], registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            "headrace_e2e_request_latency_seconds", "End-to-end request latency.", ["model"], registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.queue = Histogram(
            "headrace_request_queue_time_seconds", "Time a request waits in its engine's queue.", ["model"],
            registry=r, buckets=LATENCY_BUCKETS,
        )
        self.prompt_tokens = Counter("headrace_prompt_tokens", "Prompt tokens processed.", ["model"], registry=r)
        self.prompt_cached_tokens = Counter(
            "headrace_prompt_cached_tokens", "Of the prompt tokens, those found cached (the engine's cells or a KV "
            "tier) rather than prefilled.", ["model"], registry=r)
        self.generation_tokens = Counter("headrace_generation_tokens", "Tokens generated.", ["model"], registry=r)
        self.request_prompt_tokens = Histogram(
            "headrace_request_prompt_tokens", "Prompt tokens per LLM request.", ["model"], registry=r,
            buckets=TOKEN_BUCKETS,
        )
        self.request_generation_tokens = Histogram(
            "headrace_request_generation_tokens", "Tokens generated per LLM request.", ["model"], registry=r,
            buckets=TOKEN_BUCKETS,
        )
        self.request_success = Counter(
            "headrace_request_success", "Requests that ended, by why: stop, length, or abort (cancelled or "
            "abandoned).", ["model", "finished_reason"], registry=r,
        )
        self.request_errors = Counter("headrace_request_errors", "Requests that failed.", ["model"], registry=r)
        self.workflow_runs = Counter(
            "headrace_workflow_runs", "Workflow runs that ended, by status.", ["workflow", "status"], registry=r
        )
        self.workflow_run_seconds = Histogram(
            "headrace_workflow_run_seconds", "Workflow run latency, start to end.", ["workflow"], registry=r,
            buckets=RUN_BUCKETS,
        )
        self.batch_size = Histogram(
            "headrace_batch_size", "Items per engine batch.", ["engine", "op"], registry=r, buckets=BATCH_BUCKETS
        )
        self.scheduler_restarts = Counter(
            "headrace_scheduler_restarts", "Scheduler loops restarted after a crash.", ["engine"], registry=r
        )
        self.engine_failures = Counter(
            "headrace_engine_failures", "Engines marked failed after they were serving.", ["engine"], registry=r
        )
        # Residency under a memory budget ([residency]): loads, unloads, what they cost and who waited.
        self.engine_loads = Counter(
            "headrace_engine_loads", "Engine (model) loads, by why: startup, demand (a request waited) or "
            "preload (predicted).", ["engine", "reason"], registry=r,
        )
        self.engine_evictions = Counter(
            "headrace_engine_evictions", "Engines unloaded to make room for another.", ["engine"], registry=r
        )
        # A trim takes each arena's lock in turn: allocations on other threads wait that long.
        self.malloc_trim_seconds = Histogram(
            "headrace_malloc_trim_seconds", "Time one periodic malloc_trim took ([memory] trim_seconds).",
            registry=r, buckets=LATENCY_BUCKETS,
        )
        self.engine_load_seconds = Histogram(
            "headrace_engine_load_seconds", "Time one engine load took.", ["engine"], registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.engine_load_wait_seconds = Histogram(
            "headrace_engine_load_wait_seconds", "Time a request (or batch) waited for its engine to load: the cold "
            "start it saw.", ["engine"], registry=r, buckets=LATENCY_BUCKETS,
        )
        self.preloads = Counter(
            "headrace_preloads", "Engines loaded ahead of a call the workflow's Markov model predicted.", ["engine"],
            registry=r,
        )
        self.preload_hits = Counter(
            "headrace_preload_hits", "Preloaded engines a request used before they were unloaded again.", ["engine"],
            registry=r,
        )
        self.markov_predictions = Counter(
            "headrace_markov_predictions", "Next-engine predictions checked against the engine a run called next.",
            ["workflow"], registry=r,
        )
        self.markov_predictions_correct = Counter(
            "headrace_markov_predictions_correct", "Of those, the ones whose most likely engine was the one called.",
            ["workflow"], registry=r,
        )
        self.activity: deque[Busy] = deque(maxlen=ACTIVITY_KEEP)
        self._running: dict[str, Callable[[], int]] = {}
        self._waiting: dict[str, Callable[[], int]] = {}
        self._contexts: dict[str, Callable[[], int]] = {}
        self._engine_stats: dict[str, Callable[[], Mapping[str, int]]] = {}
        registry = self

        class _Live:
            def collect(self):
                for name, help_, table in (
                    ("headrace_num_requests_running", "Requests running on the engine.", registry._running),
                    ("headrace_num_requests_waiting", "Requests waiting for the engine.", registry._waiting),
                    ("headrace_llm_contexts", "KV contexts held by the LLM engine.", registry._contexts),
                ):
                    family = GaugeMetricFamily(name, help_, labels=["model"])
                    for model, read in table.items():
                        family.add_metric([model], read())
                    yield family
                stats = {model: read() for model, read in registry._engine_stats.items()}
                cached = {model: s for model, s in stats.items() if "prefix_cache_queries" in s}
                queries = CounterMetricFamily("headrace_prefix_cache_queries", "Prompt tokens looked up in the "
                                              "prefix cache.", labels=["model"])
                hits = CounterMetricFamily("headrace_prefix_cache_hits", "Prompt tokens the prefix cache served.",
                                           labels=["model"])
                usage = GaugeMetricFamily("headrace_prefix_cache_usage_perc", "Fraction of the prefix cache's "
                                          "token budget in use.", labels=["model"])
                for model, s in cached.items():
                    queries.add_metric([model], s["prefix_cache_queries"])
                    hits.add_metric([model], s["prefix_cache_hits"])
                    usage.add_metric([model], s["prefix_cache_tokens"] / max(1, s["prefix_cache_capacity"]))
                yield from _pin_families(cached)
                yield from _tier_families(stats)
                kv = GaugeMetricFamily("headrace_kv_cache_usage_perc", "KV-cache usage: the fraction of the "
                                       "engine's KV capacity its contexts hold (1 = full).", labels=["model"])
                for model, s in stats.items():
                    if "kv_cache_capacity" in s:
                        kv.add_metric([model], min(1.0, s["kv_cache_tokens"] / max(1, s["kv_cache_capacity"])))
                # Tensors handed between co-hosted engines (the vector store reads the embedder's memory).
                received = CounterMetricFamily("headrace_handoff_received_bytes", "Tensor bytes an engine received "
                                               "from another engine.", labels=["engine"])
                copied = CounterMetricFamily("headrace_handoff_copied_bytes", "Of those, bytes it had to copy "
                                             "(0 when the handoff is by reference).", labels=["engine"])
                store_cache = GaugeMetricFamily("headrace_vector_store_cache_bytes", "What a vector store's own "
                                                "caches hold (LanceDB's index and metadata caches).",
                                                labels=["engine"])
                for model, s in stats.items():
                    if "handoff_received_bytes" in s:
                        received.add_metric([model], s["handoff_received_bytes"])
                        copied.add_metric([model], s["handoff_copied_bytes"])
                    if "store_cache_bytes" in s:
                        store_cache.add_metric([model], s["store_cache_bytes"])
                yield from (queries, hits, usage, kv, received, copied, store_cache)

        r.register(_Live())

    def watch(self, model: str, *, running: Callable[[], int], waiting: Callable[[], int],
              contexts: Callable[[], int] | None = None,
              engine_stats: Callable[[], Mapping[str, int]] | None = None) -> None:
        """Read these gauges live at scrape time rather than mirror them.

        ``engine_stats``: an engine's ``stats()``; an LLM's ``prefix_cache_*`` keys become the
        prefix-cache metrics (vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``, in tokens), a vector
        store's ``handoff_*`` keys the handoff metrics.
        """
        self._running[model], self._waiting[model] = running, waiting
        if contexts is not None:
            self._contexts[model] = contexts
        if engine_stats is not None:
            self._engine_stats[model] = engine_stats

    def watch_residency(self, engines: Callable[[], Mapping[str, tuple[bool, int]]], budget_bytes: int) -> None:
        """Which engines are loaded and their measured footprints, read at scrape time.

        ``engines``: engine name -> (loaded now, footprint in bytes as last measured; 0 before the first load).
        """

        class _Residency:
            def collect(self):
                now = engines()
                resident = GaugeMetricFamily("headrace_engine_resident", "1 while the engine is loaded.",
                                             labels=["model"])
                footprint = GaugeMetricFamily("headrace_engine_footprint_bytes", "The engine's footprint as measured "
                                              "at its last load.", labels=["model"])
                for model, (loaded, size) in now.items():
                    resident.add_metric([model], 1 if loaded else 0)
                    footprint.add_metric([model], size)
                yield resident
                yield footprint
                yield GaugeMetricFamily("headrace_resident_bytes", "Footprints of the loaded engines together.",
                                        value=sum(size for loaded, size in now.values() if loaded))
                yield GaugeMetricFamily("headrace_residency_budget_bytes", "The memory budget the loaded engines "
                                        "stay within (0: none).", value=budget_bytes)

        self.registry.register(_Residency())

    def watch_heap(self, read: Callable[[], HeapUsage | None]) -> None:
        """malloc's bytes by state, read at each scrape (none where ``read`` gives None: no glibc)."""

        class _Heap:
            def collect(self):
                usage = read()
                if usage is None:
                    return
                family = GaugeMetricFamily("headrace_malloc_bytes", "The process's malloc bytes (every arena): "
                                           "in_use, free (the heaps' free blocks; a trim returns their whole pages "
                                           "to the system but they still count) or mapped (large blocks).",
                                           labels=["state"])
                for state in ("in_use", "free", "mapped"):
                    family.add_metric([state], getattr(usage, state))
                yield family

        self.registry.register(_Heap())

    def watch_run_history(self, usage: Callable[[], tuple[int, int, int]], budget_bytes: int) -> None:
        """The kept finished runs: their measured bytes against the budget, and how many keep their details."""

        class _RunHistory:
            def collect(self):
                held, detailed, summaries = usage()
                yield GaugeMetricFamily("headrace_run_history_bytes", "Memory the kept finished runs hold, as "
                                        "measured when each ended ([workflows] run_history_mib).", value=held)
                yield GaugeMetricFamily("headrace_run_history_budget_bytes", "What they may hold.", value=budget_bytes)
                runs = GaugeMetricFamily("headrace_run_history_runs", "Finished runs kept: with their details, or "
                                         "as summaries only (details dropped past the budget).", labels=["details"])
                runs.add_metric(["kept"], detailed)
                runs.add_metric(["dropped"], summaries)
                yield runs

        self.registry.register(_RunHistory())

    def watch_optimizer(self, stats: Any) -> None:
        """The e-graph cache's hit rate and graph-building time, read at scrape time."""

        class _Optimizer:
            def collect(self):
                yield CounterMetricFamily("headrace_egraph_cache_hits", "E-graph cache hits.", value=stats.hits)
                yield CounterMetricFamily("headrace_egraph_cache_misses", "E-graph cache misses.", value=stats.misses)
                yield CounterMetricFamily("headrace_graph_build_seconds", "Time spent building and optimizing graphs.",
                                          value=stats.build_seconds)

        self.registry.register(_Optimizer())

    def batch_observer(self, engine: str) -> Callable[[str, int, float, float], None]:
        def observe(op: str, size: int, start: float, end: float) -> None:
            self.batch_size.labels(engine, op).observe(size)
            self.activity.append(Busy(engine, op, size, start, end))  # deque.append is atomic across threads

        return observe

    def busy_between(self, start: float, end: float) -> list[Busy]:
        """The engine batches that overlap [start, end]."""
        out = []
        # list() copies under the GIL; iterating the deque itself races the engines' threads.
        for busy in reversed(list(self.activity)):  # newest first: stop once past the window
            if busy.end < start:
                break
            if busy.start <= end:
                out.append(busy)
        return out[::-1]

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # SchedulerObserver ---------------------------------------------------------

    def queued(self, engine: str) -> None:
        pass

    def started(self, engine: str, queue_seconds: float) -> None:
        self.queue.labels(engine).observe(queue_seconds)

    def first_token(self, engine: str, seconds: float) -> None:
        self.ttft.labels(engine).observe(seconds)

    def next_token(self, engine: str, seconds: float) -> None:
        self.itl.labels(engine).observe(seconds)

    def finished(self, engine: str, seconds: float, prompt_tokens: int, generation_tokens: int,
                 finish_reason: str, cached_tokens: int = 0) -> None:
        self.e2e.labels(engine).observe(seconds)
        if finish_reason == "error":
            self.request_errors.labels(engine).inc()
        else:
            self.request_success.labels(engine, finish_reason).inc()
        if prompt_tokens:
            self.prompt_tokens.labels(engine).inc(prompt_tokens)
            self.prompt_cached_tokens.labels(engine).inc(min(cached_tokens, prompt_tokens))
        if generation_tokens:
            self.generation_tokens.labels(engine).inc(generation_tokens)
        if prompt_tokens or generation_tokens:  # an LLM request (other engines report no tokens)
            self.request_prompt_tokens.labels(engine).observe(prompt_tokens)
            self.request_generation_tokens.labels(engine).observe(generation_tokens)

    # RunObserver ---------------------------------------------------------------

    def run_finished(self, workflow: str, status: str, seconds: float) -> None:
        self.workflow_runs.labels(workflow, status).inc()
        self.workflow_run_seconds.labels(workflow).observe(seconds)


def _pin_families(cached: Mapping[str, Mapping[str, int]]) -> Iterator[Any]:
    """The prefix cache's pins and evictions (issue 28), for the engines that report them."""
    pinned = GaugeMetricFamily("headrace_prefix_cache_pinned_tokens", "Tokens of the prefix cache's pinned entries "
                               "(a program's retained context, a client's cache_control prefix).", labels=["model"])
    evictions = CounterMetricFamily("headrace_prefix_cache_evictions", "Prefix-cache entries evicted, by reason: lru, "
                                    "next_use (a predicted next use chose another than LRU), superseded (a longer "
                                    "entry holds it all).", labels=["model", "reason"])
    pins = CounterMetricFamily("headrace_prefix_cache_pins", "Prefix-cache pins by outcome: pinned (made or renewed), "
                               "expired, refused (the pin budget was full).", labels=["model", "outcome"])
    for model, s in cached.items():
        if "prefix_cache_pinned_tokens" not in s:
            continue
        pinned.add_metric([model], s["prefix_cache_pinned_tokens"])
        for reason in ("lru", "next_use", "superseded"):
            evictions.add_metric([model, reason], s[f"prefix_cache_evictions_{reason}"])
        for outcome, key in (("pinned", "prefix_cache_pins"), ("expired", "prefix_cache_pins_expired"),
                             ("refused", "prefix_cache_pins_refused")):
            pins.add_metric([model, outcome], s[key])
    yield from (pinned, evictions, pins)


def _tier_families(stats: Mapping[str, Mapping[str, float]]) -> Iterator[Any]:
    """The KV tiers below an engine's cells (issue 42: host memory, disk), for the engines that have them."""
    hits = CounterMetricFamily("headrace_kv_tier_hits", "Prompts whose prefix a KV tier restored instead of the "
                               "engine prefilling it.", labels=["model", "tier"])
    tokens = CounterMetricFamily("headrace_kv_tier_hit_tokens", "Prompt tokens a KV tier restored (not prefilled).",
                                 labels=["model", "tier"])
    seconds = CounterMetricFamily("headrace_kv_tier_restore_seconds", "Time spent restoring from a KV tier (reading "
                                  "a file included).", labels=["model", "tier"])
    used = GaugeMetricFamily("headrace_kv_tier_bytes", "Bytes a KV tier holds.", labels=["model", "tier"])
    capacity = GaugeMetricFamily("headrace_kv_tier_capacity_bytes", "A KV tier's byte budget (0: off).",
                                 labels=["model", "tier"])
    dropped = CounterMetricFamily("headrace_kv_tier_files_dropped", "KV files found torn, truncated, corrupted, "
                                  "foreign or stale, and removed.", labels=["model"])
    for model, s in stats.items():
        if "kv_store_files_dropped" not in s:
            continue
        for tier in ("host", "disk"):
            hits.add_metric([model, tier], s[f"kv_store_{tier}_hits"])
            tokens.add_metric([model, tier], s[f"kv_store_{tier}_hit_tokens"])
            seconds.add_metric([model, tier], s[f"kv_store_{tier}_restore_seconds"])
            used.add_metric([model, tier], s[f"kv_store_{tier}_bytes"])
            capacity.add_metric([model, tier], s[f"kv_store_{tier}_capacity"])
        dropped.add_metric([model], s["kv_store_files_dropped"])
    yield from (hits, tokens, seconds, used, capacity, dropped)
