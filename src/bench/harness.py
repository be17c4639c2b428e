"""The benchmark harness: every mode of a workload against one daemon, in one run.

Phases per workload, each on the same engines:

1. single query: one warm-up per mode, then ``reps`` repetitions with the modes
   interleaved round-robin (the order rotating each repetition, so drift hits
   every mode alike). Each repetition also runs the workflow once isolated (one
   primitive at a time) to get that input's critical-path bound, and each
   headrace run's timeline gives its overhead;
2. load: Poisson arrivals per rate and mode, the SLO set from the baseline's
   single-query latency. Rates are given, or fractions of the measured capacity
   (one over the baseline's single-query latency); a load point is a fixed
   number of arrivals (``arrivals``) or a fixed window.

Then the mixed load: two workflows co-located, sharing the LLM (with plain chat
traffic on a shared system prompt if asked); and the chat phase: time to first
token with a shared 1,000-token system prompt, prefix caching off and on.

Each mode runs under its LLM policy (``llm_policy_of``), set on the daemon's LLM
engine through ``PATCH /v1/engines/{engine}`` before the mode's requests go out;
the daemon's own policy is restored at the end.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import anyio

from headrace.bench.baselines import MissingPeer
from headrace.bench.client import BenchError, Daemon
from headrace.bench.corpus import Corpus
from headrace.bench.critical_path import critical_path, engine_bound
from headrace.bench.load import percentile, poisson
from headrace.bench.measure import batch_sizes_between, overhead
from headrace.graph.workflows.common import CHUNK_CONFIG
from headrace.bench.workloads import (
    BENCH_COLLECTION,
    HEADRACE,
    MIXED,
    MIXED_MODES,
    SEQUENTIAL,
    WORKLOADS,
    Workload,
    default_modes,
    is_headrace,
    llm_policy_of,
    max_runs_of,
    server_modes,
    split_mode,
)

ISOLATED = {**server_modes()[HEADRACE], "isolate": True}
RUN_TIMEOUT_S = 900  # a run that never ends is a bug to report, not a reason to wait forever
BASELINE_MODES = ("llamaindex", "chaining", "semantic", "client")  # client-side modes


@dataclass
class Options:
    workloads: list[str]
    modes: list[str] | None = None  # None: each workload's defaults
    ladder: set[str] = field(default_factory=set)  # workloads whose passes are switched on in turn (single query)
    reps: int = 3
    warmup: bool = True  # one unmeasured run per mode before the single-query repetitions
    rates: list[float] = field(default_factory=list)  # req/s
    load_fractions: list[float] = field(default_factory=list)  # x the measured capacity; with rates: both
    arrivals: int | None = None  # arrivals per load point; None: as many as ``duration`` draws
    load_modes: list[str] | None = None  # None: the baseline and headrace
    load_workloads: set[str] | None = None  # None: every workload (when there are rates)
    duration: float = 60.0
    drain: float | None = None  # None: 2 x the SLO
    mixed_rate: float | None = None  # req/s over both workflows; None: no mixed load
    mixed_chat: bool = False  # the mixed load carries plain chat traffic too (a third of the arrivals)
    mixed_modes: list[str] = field(default_factory=lambda: list(MIXED_MODES))  # run after the baselines
    chat: int = 0  # chat requests per caching mode in the chat phase; 0: no chat phase
    system_tokens: int = 1000  # the chat traffic's shared system prompt
    seed: int = 0
    max_tokens: int | None = None  # override every workload's output length
    agents: Any = None  # an agents.AgentsOptions: run the agents benchmark (agents_phase.py) after the rest
    mixed_programs: Any = None  # a mixed.MixedOptions: run the mixed benchmark (mixed_phase.py) after that
    log: Callable[[str], None] = print


@dataclass
class Call:
    latency_s: float
    answer: str
    run_id: str | None = None


class Systems:
    """Every mode's way to run a workload, all against the same daemon."""

    def __init__(self, daemon: Daemon, tokenizer: Callable[[str], list] | None = None) -> None:
        self.daemon = daemon
        self.tokenizer = tokenizer
        self.models: dict[str, str] = {}
        self._baselines: dict[str, Any] = {}
        self.configured_policy: str | None = None  # the daemon's own LLM policy, restored by ``finish``
        self._policy: str | None = None  # the LLM policy in force now
        self.configured_max_runs: int | None = None  # the daemon's own bound on runs at once, likewise
        self._max_runs: int | None = None
        self.configured_prefix_caching: bool | None = None  # the daemon's own switch, restored by ``finish``
        self._prefix_caching = False  # the LLM keeps a prefix cache (emptied before each measured query)

    async def start(self) -> None:
        kinds = await self.daemon.models()
        for kind in ("llm", "embed", "rerank"):
            names = [m for m, k in kinds.items() if k == kind]
            if names:
                self.models[kind] = names[0]
        if "llm" in self.models:
            settings = await self.daemon.engine_settings(self.models["llm"])
            self.configured_policy = self._policy = settings["llm_policy"]
            self.configured_max_runs = self._max_runs = settings["max_runs"]
            self.configured_prefix_caching = self._prefix_caching = bool(settings.get("prefix_caching"))

    async def cold_cache(self) -> None:
        """Empty the LLM's prefix cache (switched off and on again). Every mode of a repetition asks about the
        same document: without this the first mode fills the cache and the modes after it reuse its KV."""
        if self._prefix_caching:
            await self.use_prefix_caching(False)
            await self.use_prefix_caching(True)

    async def use_prefix_caching(self, on: bool) -> None:
        """Switch the LLM's prefix cache on or off; off empties it."""
        await self.daemon.engine_settings(self.models["llm"], prefix_caching=on)
        self._prefix_caching = on

    async def finish(self) -> None:
        """Restore the daemon's own LLM settings and close the baselines' clients."""
        try:
            if self.configured_policy is not None:
                await self.use_policy(self.configured_policy, self.configured_max_runs)
            if self.configured_prefix_caching is not None and self._prefix_caching != self.configured_prefix_caching:
                await self.use_prefix_caching(self.configured_prefix_caching)
        finally:
            # In this loop: an SDK client left to the garbage collector closes itself in whatever loop runs then.
            baselines, self._baselines = list(self._baselines.values()), {}
            for baseline in baselines:
                await baseline.aclose()

    async def use_policy(self, policy: str | None, max_runs: int | None = None) -> None:
        """Put the LLM under ``policy`` and ``max_runs`` (None: the daemon's own) unless it is already."""
        policy = policy or self.configured_policy
        max_runs = self.configured_max_runs if max_runs is None else max_runs
        if "llm" not in self.models or policy is None:
            return
        changes = {**({"llm_policy": policy} if policy != self._policy else {}),
                   **({"max_runs": max_runs} if max_runs is not None and max_runs != self._max_runs else {})}
        if changes:
            await self.daemon.engine_settings(self.models["llm"], **changes)
            self._policy, self._max_runs = policy, max_runs

    def baseline(self, mode: str) -> Any:
        """The client-side system for ``mode``; MissingPeer if its library is not installed."""
        if mode not in self._baselines:
            d = self.daemon
            if mode == "llamaindex":
                from headrace.bench.baselines.llamaindex import LlamaIndexRAG

                self._baselines[mode] = LlamaIndexRAG(f"{d.base_url}/v1", d.api_key or "none", self.models["llm"],
                                                      self.models["embed"], self.models["rerank"], self.tokenizer)
            elif mode == "chaining":
                from headrace.bench.baselines.chaining import ClientChaining

                self._baselines[mode] = ClientChaining(f"{d.base_url}/v1", d.api_key or "none", self.models["llm"])
            elif mode == "client":
                from headrace.bench.baselines.dynamic_clients import ClientLoops

                self._baselines[mode] = ClientLoops(f"{d.base_url}/v1", d.api_key or "none", self.models["llm"])
            elif mode == "semantic":
                from headrace.bench.baselines.semantic import SemanticCalls

                self._baselines[mode] = SemanticCalls(d.base_url, d.api_key or "none", self.models["llm"])
            else:
                raise BenchError(f"unknown mode {mode!r}")
        return self._baselines[mode]

    async def call(self, mode: str, workload: Workload, inputs: dict[str, Any], config: dict[str, Any]) -> Call:
        await self.use_policy(llm_policy_of(mode), max_runs_of(mode))
        try:
            with anyio.fail_after(RUN_TIMEOUT_S):
                return await self._call(mode, workload, inputs, config)
        except TimeoutError:
            raise BenchError(f"{workload.name} in mode {mode} did not finish in {RUN_TIMEOUT_S}s") from None

    async def _call(self, mode: str, workload: Workload, inputs: dict[str, Any], config: dict[str, Any]) -> Call:
        if mode in BASELINE_MODES:
            system = self.baseline(mode)
            t0 = time.perf_counter()
            result = await system.run(workload.workflow, inputs, config)
            return Call(time.perf_counter() - t0, _answer(result))
        extra = ISOLATED if mode == "isolated" else server_modes().get(split_mode(mode)[0])
        if extra is None:
            raise BenchError(f"unknown mode {mode!r}")
        run = await self.daemon.run(workload.workflow, inputs, {**config, **extra})
        return Call(run.latency_s, _answer(run.result), run.run_id)


def _answer(result: dict[str, Any]) -> str:
    for key in ("answer", "summary", "draft"):
        if result.get(key):
            return str(result[key])
    return str(result)


def check_modes(workload: Workload, modes: list[str]) -> None:
    allowed = set(server_modes()) | ({workload.baseline} if workload.baseline else set()) | set(workload.client_modes)
    bad = []
    for m in modes:
        try:
            base = split_mode(m)[0]
        except ValueError as exc:
            raise BenchError(str(exc)) from None
        if base not in allowed:
            bad.append(m)
    if bad:
        raise BenchError(f"{workload.name} has no mode(s) {bad}; choose from {sorted(allowed)} (a headrace mode may "
                         "add @N: the LLM serves at most N runs at once)")


def workload_config(workload: Workload, opts: Options) -> dict[str, Any]:
    config = dict(workload.config)
    if opts.max_tokens is not None:
        config["max_tokens"] = opts.max_tokens
    return config


async def single_query(systems: Systems, workload: Workload, modes: list[str], corpus: Corpus,
                       opts: Options) -> dict[str, Any]:
    config = workload_config(workload, opts)
    daemon = systems.daemon
    warm = len(corpus.questions) - 1  # the warm-up input is never measured
    for mode in modes if opts.warmup else ():  # warms every engine and shape; the isolated runs need none
        await systems.call(mode, workload, workload.inputs(corpus, warm), config)
    runs: list[dict[str, Any]] = []
    bounds: list[dict[str, Any]] = []
    timeline = None  # headrace's first measured run, for the Gantt plot
    for rep in range(opts.reps):
        inputs = workload.inputs(corpus, rep)
        order = modes[rep % len(modes):] + modes[: rep % len(modes)]
        for mode in order + ["isolated"]:
            await systems.cold_cache()
            call = await systems.call(mode, workload, inputs, config)
            if mode == "isolated":
                graph, tl = await daemon.graph(call.run_id), await daemon.timeline(call.run_id)
                bound = critical_path(graph, tl["nodes"])
                busiest, busiest_s = engine_bound(tl)
                bounds.append({"rep": rep, "run": call.run_id, "isolated_s": call.latency_s, **bound.to_json(),
                               "busiest_engine": busiest, "busiest_engine_s": busiest_s})
                continue
            record = {"mode": mode, "rep": rep, "question": inputs.get("question", ""), "latency_s": call.latency_s,
                      "answer": call.answer[:400], "run": call.run_id}
            if call.run_id is not None:
                tl = await daemon.timeline(call.run_id)
                record["overhead"] = overhead(call.latency_s, tl)
                if is_headrace(mode) and timeline is None:
                    timeline = tl
            runs.append(record)
        opts.log(f"    rep {rep}: " + ", ".join(f"{r['mode']} {r['latency_s']:.2f}s" for r in runs if r["rep"] == rep))
    return {**summarize_single(workload, modes, runs, bounds), "warmup": opts.warmup, "timeline": timeline}


def summarize_single(workload: Workload, modes: list[str], runs: list[dict], bounds: list[dict]) -> dict[str, Any]:
    by_mode = {m: [r for r in runs if r["mode"] == m] for m in modes}
    mean_lat = {m: statistics.fmean(r["latency_s"] for r in rs) for m, rs in by_mode.items()}
    table = {}
    for m, rs in by_mode.items():
        row = {"reps": len(rs), "mean_s": mean_lat[m], "median_s": statistics.median(r["latency_s"] for r in rs),
               "latencies_s": [r["latency_s"] for r in rs]}
        for base in (workload.baseline, SEQUENTIAL):
            if base in mean_lat and base != m:
                row[f"speedup_vs_{base}"] = mean_lat[base] / mean_lat[m]
        with_overhead = [r["overhead"] for r in rs if "overhead" in r]
        if with_overhead:
            row["overhead_share"] = statistics.fmean(o["share"] for o in with_overhead)
            row["overhead"] = {k: statistics.fmean(o[k] for o in with_overhead)
                               for k in ("e2e_s", "compute_s", "overhead_s", "client_s", "executor_s")}
        table[m] = row
    out: dict[str, Any] = {"modes": table, "runs": runs, "critical_path": bounds}
    headrace_runs = {r["rep"]: r["latency_s"] for r in by_mode.get(HEADRACE, [])}
    ratios = [headrace_runs[b["rep"]] / b["seconds"] for b in bounds if b["rep"] in headrace_runs and b["seconds"] > 0]
    if ratios:
        out["bound_s"] = statistics.fmean(b["seconds"] for b in bounds)
        out["latency_over_bound"] = statistics.fmean(ratios)
        # The tighter lower bound: the path, or the busiest engine's total compute if that is longer.
        out["tight_bound_s"] = statistics.fmean(max(b["seconds"], b["busiest_engine_s"]) for b in bounds)
        out["latency_over_tight_bound"] = statistics.fmean(
            headrace_runs[b["rep"]] / max(b["seconds"], b["busiest_engine_s"]) for b in bounds if b["rep"] in headrace_runs)
    return out


def slo_for(workload: Workload, single: dict[str, Any] | None) -> float | None:
    """factor x the baseline's single-query latency (the in-daemon module chain's if there is no peer, else
    the first mode's)."""
    if not single:
        return None
    for mode in (workload.baseline, SEQUENTIAL, HEADRACE, *single["modes"]):
        if mode in single["modes"]:
            return workload.slo_factor * single["modes"][mode]["mean_s"]
    return None


def capacity_for(workload: Workload, single: dict[str, Any] | None) -> float | None:
    """Single-run throughput (req/s): one over the baseline's single-query latency, as ``slo_for`` picks it."""
    if not single:
        return None
    for mode in (workload.baseline, SEQUENTIAL, HEADRACE, *single["modes"]):
        if mode in single["modes"]:
            return 1.0 / single["modes"][mode]["mean_s"]
    return None


def load_rates(opts: Options, capacity: float | None) -> list[float]:
    rates = list(opts.rates)
    if opts.load_fractions:
        if capacity is None:
            raise BenchError("--load-fractions need the single-query phase (reps > 0) to measure the capacity")
        rates += [round(f * capacity, 4) for f in opts.load_fractions]
    return rates


async def load_phase(systems: Systems, workload: Workload, modes: list[str], corpus: Corpus, opts: Options,
                     slo_s: float, rates: list[float], capacity: float | None = None) -> dict[str, Any]:
    config = workload_config(workload, opts)
    out: dict[str, Any] = {"slo_s": slo_s, "capacity": capacity, "series": {m: [] for m in modes},
                           "batch_sizes": {m: [] for m in modes}}
    for rate in rates:
        for mode in modes:
            await systems.use_policy(llm_policy_of(mode), max_runs_of(mode))
            before = await systems.daemon.metrics()

            run_config = with_slo(mode, config, slo_s)

            async def request(i: int, mode: str = mode, run_config: dict[str, Any] = run_config) -> None:
                await systems.call(mode, workload, workload.inputs(corpus, i), run_config)

            res = await poisson({workload.name: request}, rate, opts.duration, slo_s, opts.seed,
                                opts.drain if opts.drain is not None else 2 * slo_s, count=opts.arrivals)
            out["batch_sizes"][mode] += batch_sizes_between(before, await systems.daemon.metrics())
            summary = res.summary()
            out["series"][mode].append(summary)
            opts.log(f"    load {rate:g} req/s, {mode}: {summary['completed']}/{summary['offered']} done, "
                     f"p50 {_fmt(summary['p50_s'])} p95 {_fmt(summary['p95_s'])}, goodput {summary['goodput']:.3f}/s")
    return out


def with_slo(mode: str, config: dict[str, Any], slo_s: float) -> dict[str, Any]:
    """A server-side run states its latency objective (``slo_seconds``), as a client of a workflow server
    would; the schedulers may use it (the ``deadline`` policy does). A baseline's requests cannot carry it."""
    return config if mode in BASELINE_MODES else {**config, "slo_seconds": round(slo_s, 3)}


CHAT = "chat"
CHAT_TOKENS = 16  # a chat answer's length in the chat traffic


def system_prompt(corpus: Corpus, tokenizer: Callable[[str], list] | None, tokens: int) -> str:
    """A shared system prompt of about ``tokens`` tokens: corpus prose (a product manual, say)."""
    text = "Answer questions about this Python library reference.\n\n" + "\n".join(d.text for d in corpus.documents)
    if tokenizer is None:
        return text[: tokens * 4]
    cut = min(len(text), tokens * 6)
    while cut > 0 and len(tokenizer(text[:cut])) > tokens:
        cut = int(cut * 0.95)
    return text[:cut]


def chat_messages(system: str, corpus: Corpus, i: int) -> list[dict[str, str]]:
    q = corpus.questions[i % len(corpus.questions)]
    return [{"role": "system", "content": system}, {"role": "user", "content": f"({i}) {q.text}"}]


async def chat_phase(systems: Systems, corpus: Corpus, opts: Options) -> dict[str, Any]:
    """Time to first token of chats sharing a long system prompt, the LLM's prefix caching off, then on.

    Requests go one at a time (no queueing in the figure); each asks a distinct question. The
    cache is emptied by switching it off, so the "on" mode starts cold and its first request fills it.
    """
    llm = systems.models["llm"]
    system = system_prompt(corpus, systems.tokenizer, opts.system_tokens)
    out: dict[str, Any] = {"requests": opts.chat, "system_tokens": len(systems.tokenizer(system))
                           if systems.tokenizer else None, "modes": {}}
    for mode, caching in (("no prefix caching", False), ("prefix caching", True)):
        await systems.use_prefix_caching(False)  # empties it
        if caching:
            await systems.use_prefix_caching(True)
        ttfts = []
        for i in range(opts.chat):
            ttft, _ = await systems.daemon.chat_stream(llm, chat_messages(system, corpus, i), CHAT_TOKENS)
            ttfts.append(ttft)
        warm = ttfts[1:] if caching else ttfts  # with caching, the first request fills the cache
        out["modes"][mode] = {"ttft_s": ttfts, "mean_s": statistics.fmean(warm),
                              "p50_s": percentile(sorted(warm), 50), "p95_s": percentile(sorted(warm), 95)}
        opts.log(f"    chat, {mode}: mean TTFT {out['modes'][mode]['mean_s'] * 1000:.0f} ms over {len(warm)}")
    off, on = out["modes"]["no prefix caching"]["mean_s"], out["modes"]["prefix caching"]["mean_s"]
    out["ttft_speedup"] = off / on if on else None
    return out


async def mixed_phase(systems: Systems, corpus: Corpus, opts: Options, slos: dict[str, float]) -> dict[str, Any]:
    """Ayo §7.2: two workflows at once on the shared LLM (and chat traffic, if asked); each mode its own way."""
    workloads = [WORKLOADS[w] for w in MIXED]
    modes = {"baselines": {w.name: w.baseline or SEQUENTIAL for w in workloads}}
    modes.update({mode: {w.name: mode for w in workloads} for mode in opts.mixed_modes})
    tags = list(MIXED) + ([CHAT] if opts.mixed_chat else [])
    slos = dict(slos)
    system = system_prompt(corpus, systems.tokenizer, opts.system_tokens) if opts.mixed_chat else ""
    if opts.mixed_chat:
        # A chat's SLO: 3x its latency alone (measured once, cache warm, as a served chatbot's is).
        await systems.use_policy("fifo")
        await systems.daemon.chat_stream(systems.models["llm"], chat_messages(system, corpus, 0), CHAT_TOKENS)
        _, alone = await systems.daemon.chat_stream(systems.models["llm"], chat_messages(system, corpus, 1), CHAT_TOKENS)
        slos[CHAT] = 3 * alone
    out: dict[str, Any] = {"workloads": tags, "rate": opts.mixed_rate, "modes": {}, "slo_s": slos}
    for name, per_workload in modes.items():
        await systems.use_policy(llm_policy_of(per_workload[MIXED[0]]), max_runs_of(per_workload[MIXED[0]]))
        requests = {}
        for w in workloads:
            config = with_slo(per_workload[w.name], workload_config(w, opts), slos[w.name])

            async def request(i: int, w: Workload = w, config: dict = config) -> None:
                await systems.call(per_workload[w.name], w, w.inputs(corpus, i), config)

            requests[w.name] = request
        if opts.mixed_chat:

            async def chat(i: int) -> None:
                await systems.daemon.chat_stream(systems.models["llm"], chat_messages(system, corpus, i), CHAT_TOKENS)

            requests[CHAT] = chat
        res = await poisson(requests, opts.mixed_rate, opts.duration, max(slos.values()), opts.seed,
                            opts.drain if opts.drain is not None else 2 * max(slos.values()), count=opts.arrivals)
        out["modes"][name] = {w: res.summary(tag=w, slo_s=slos[w]) for w in tags}
        out["modes"][name]["all"] = {"goodput": sum(out["modes"][name][w]["goodput"] for w in tags)}
        opts.log(f"    mixed {opts.mixed_rate:g} req/s, {name}: " + ", ".join(
            f"{w} p50 {_fmt(out['modes'][name][w]['p50_s'])} goodput {out['modes'][name][w]['goodput']:.3f}/s" for w in tags))
    return out


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}s"


async def index_collection(systems: Systems, corpus: Corpus, modes: list[str], opts: Options) -> dict[str, Any]:
    """Index the whole corpus once, before any query: headrace's persistent collection, and the same chunks
    as one LlamaIndex index kept by the baseline. Each side's indexing time is reported, not measured per query."""
    documents = [d.text for d in corpus.documents]
    size, overlap = CHUNK_CONFIG["chunk_size"]["default"], CHUNK_CONFIG["chunk_overlap"]["default"]
    t0 = time.perf_counter()
    chunks = await systems.daemon.index_collection(BENCH_COLLECTION, documents, size, overlap)
    out: dict[str, Any] = {"name": BENCH_COLLECTION, "documents": len(documents), "chunks": chunks,
                           "index_s": {"headrace": time.perf_counter() - t0}}
    if "llamaindex" in modes:
        t0 = time.perf_counter()
        await systems.baseline("llamaindex").index_collection(BENCH_COLLECTION, documents, size, overlap)
        out["index_s"]["llamaindex"] = time.perf_counter() - t0
    opts.log(f"    indexed {len(documents)} documents ({chunks} chunks) once: " + ", ".join(
        f"{system} {seconds:.2f}s" for system, seconds in out["index_s"].items()))
    return out


async def run_all(systems: Systems, corpus: Corpus, opts: Options) -> dict[str, Any]:
    await systems.start()
    try:
        results = await _run_phases(systems, corpus, opts)
    except BaseException:
        # The daemon's own LLM settings back however a phase failed; the phase's error is the one to report.
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await systems.finish()
        raise
    await systems.finish()
    return results


async def _run_phases(systems: Systems, corpus: Corpus, opts: Options) -> dict[str, Any]:
    results: dict[str, Any] = {"workloads": {}}
    slos: dict[str, float] = {}
    if opts.mixed_rate:  # a bad mixed mode fails here, before the hours of the phases ahead of it
        not_headrace = [m for m in opts.mixed_modes if not is_headrace(m)]
        if not_headrace:
            raise BenchError(f"--mixed-rate-modes takes headrace modes (the baselines always run): {not_headrace}")
        for name in MIXED:
            check_modes(WORKLOADS[name], opts.mixed_modes)
    for name in opts.workloads:
        workload = WORKLOADS[name]
        modes = opts.modes or default_modes(workload, name in opts.ladder)
        check_modes(workload, modes)
        for mode in modes:  # a missing peer library fails here, before anything is measured
            if mode in BASELINE_MODES:
                systems.baseline(mode)
        opts.log(f"  {name}: modes {', '.join(modes)}")
        section: dict[str, Any] = {"modes": modes, "config": workload_config(workload, opts)}
        if workload.collection:
            section["collection"] = await index_collection(systems, corpus, [*modes, *(opts.load_modes or ())], opts)
        if opts.reps > 0:
            section["single"] = await single_query(systems, workload, modes, corpus, opts)
        slo = slo_for(workload, section.get("single"))
        if slo is not None:
            slos[name] = slo
        wants_load = opts.rates or opts.load_fractions
        if wants_load and (opts.load_workloads is None or name in opts.load_workloads):
            if slo is None:
                raise BenchError(f"{name}: a load run needs the single-query phase (reps > 0) to set its SLO")
            # A baseline named for the load is run by the workloads it belongs to (llamaindex: RAG).
            load_modes = [m for m in opts.load_modes or [workload.baseline, HEADRACE]
                          if m and (m not in BASELINE_MODES or m == workload.baseline or m in workload.client_modes)]
            check_modes(workload, load_modes)
            capacity = capacity_for(workload, section.get("single"))
            section["load"] = await load_phase(systems, workload, load_modes, corpus, opts, slo,
                                               load_rates(opts, capacity), capacity)
        results["workloads"][name] = section
    if opts.chat:
        results["chat"] = await chat_phase(systems, corpus, opts)
    if opts.mixed_rate:
        missing = [w for w in MIXED if w not in slos]
        if missing:
            raise BenchError(f"the mixed load needs the single-query phase of {missing} for their SLOs")
        results["mixed"] = await mixed_phase(systems, corpus, opts, slos)
    if opts.agents is not None:
        from headrace.bench.agents_phase import agents_phase

        results["agents"] = await agents_phase(systems, corpus, opts.agents, opts.log)
    if opts.mixed_programs is not None:
        from headrace.bench.mixed_phase import RESULTS_KEY, mixed_programs_phase

        results[RESULTS_KEY] = await mixed_programs_phase(systems, corpus, opts.mixed_programs, opts.log)
    return results


__all__ = ["Options", "Systems", "run_all", "MissingPeer", "BenchError"]
