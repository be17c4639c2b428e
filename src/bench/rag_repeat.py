"""``headrace bench rag-repeat``: RAG over a persistent collection whose popular chunks recur (issue 42, item 5).

A collection of at least ``min_chunks`` chunks (the bench corpus grown until the workflows' default chunking,
256 words, yields that many) is indexed once per daemon. Queries ask about the corpus's topics (the functions
and classes documented) with Zipf-like popularity (``zipf`` s over a seeded shuffle of the topics), so a few
chunks are retrieved by most queries, as RAGCache found in real traces. ``naive_rag`` and ``advanced_rag``
answer them over the collection (``max_tokens`` 24; the workflows decode greedily).

Each mode is its own daemon, started from ``--config`` with the LLM's engine options (and the runs' workflow
config) overridden, on a fresh data dir, so every mode's KV tiers start empty (``MODES``). The LLM reranker
(advanced_rag) follows each mode's order: the query first in the question-first modes, the document first (scored
through the prefix cache and tiers, ``llm-rerank``'s ``document_first``) in the context-first ones:

- ``engine-cache``: the prefix cache in the engine's cells only (``kv_host_mib`` = ``kv_disk_mib`` = 0), the
  question before the chunks (``context_first = false``, the workflows' order until 2026-11-29);
- ``tiers``: the host-memory and disk tiers on (sized from the machine unless the config sizes them), the
  question first;
- ``tiers-context-first``: the tiers, and the workflows' ``context_first`` order, so a retrieved chunk's KV
  is an exact prefix of every later prompt that retrieves it;
- ``chunk-kv``: as ``tiers-context-first``, and the collection's ``chunk_kv`` on: every chunk prefilled when it
  is ingested (the ingest's time and tokens reported), so a chunk's first retrieval is a hit too;
- ``placed-context-first``: as ``chunk-kv``, on an engine with ``place_documents`` (the defaults since issue 49):
  each chunk's KV also computed alone at ingest, so the chunks after a prompt's first are placed, not prefilled;
- ``placed``: the question first, the tiers, ``chunk_kv`` on an engine with ``place_documents``: each chunk's KV
  computed alone at ingest and placed wherever a prompt puts it, its first 16 tokens recomputed (close to a
  full prefill, not equal: the report's same-answer share says how close);
- ``llama-server``: the peer a user would assemble (``rag_repeat_peer``): the same pipelines driven from the
  client against llama.cpp's ``llama-server -np 16 --cache-ram 8192 --cache-reuse 256``.

Per workflow: the capacity is one over ``engine-cache``'s mean latency over ``probe`` warm queries one at a
time; each load point (a fraction of it) offers ``arrivals`` seeded Poisson arrivals, the same times and the
same queries in every mode. Each run is streamed: its time to first token is the first token of the final
answer (the run's first ``node.partial`` event with a ``delta``). Prompt, cached and prefilled tokens come from
the daemon's /metrics before and after the point. Then the ``restart`` phase (``rag_repeat_report`` says what
each figure means), and the report: per workflow and point, latency, TTFT, tokens prefilled per query, tier
hits, and the share of answers identical to ``engine-cache``'s on the same queries.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import anyio

from headrace.bench.client import BenchError, Daemon
from headrace.bench.corpus import Corpus
from headrace.bench.load import percentile, poisson
from headrace.bench.rag_repeat_daemon import mode_config, started, token_counts
from headrace.bench.rag_repeat_workload import (CHUNK_OVERLAP, CHUNK_SIZE, Query, chunk_count, corpus_for,
                                                draw_queries, topics_of)

RAG_REPEAT = "rag-repeat"  # the benchmark's name on the ``headrace bench`` command line
COLLECTION = "rag_repeat_corpus"
WORKFLOWS = ("naive_rag", "advanced_rag")
MAX_TOKENS = 24
PEER = "llama-server"
ENGINE_CACHE = "engine-cache"


@dataclass(frozen=True)
class ModeSpec:
    """One mode: the LLM's engine options over the config's, the runs' workflow config, or why it cannot run."""

    engine_options: dict[str, Any] = field(default_factory=dict)  # None as a value: the key removed (its default)
    workflow_config: dict[str, Any] = field(default_factory=dict)
    skip: str | None = None  # why this mode is not run (said in the report)
    chunk_kv: bool = False  # the collection's chunks prefilled when ingested (headrace.daemon.collection_kv)
    rerank_options: dict[str, Any] = field(default_factory=dict)  # the llm-rerank engines' options over the config's


TIERS_ON = {"kv_host_mib": None, "kv_disk_mib": None}  # unset: sized from the machine (a 0 in the config goes)
QUESTION_FIRST = {"context_first": False}  # the baselines' order, whatever the workflows' default
# The LLM reranker's prompts in the mode's order too: the query first (each candidate computed for every query), or
# the document first, scored through the prefix cache and tiers (a candidate scored once is restored after).
QUERY_FIRST_RERANK, DOCUMENT_FIRST_RERANK = {"document_first": False}, {"document_first": True}
PLACE_OFF, PLACE_ON = {"place_documents": False}, {"place_documents": True}  # the engine's, and the workflow's
MODES: dict[str, ModeSpec] = {
    ENGINE_CACHE: ModeSpec({"kv_host_mib": 0, "kv_disk_mib": 0, **PLACE_OFF}, QUESTION_FIRST,
                           rerank_options=QUERY_FIRST_RERANK),
    "tiers": ModeSpec({**TIERS_ON, **PLACE_OFF}, QUESTION_FIRST, rerank_options=QUERY_FIRST_RERANK),
    "tiers-context-first": ModeSpec({**TIERS_ON, **PLACE_OFF}, {"context_first": True, **PLACE_OFF},
                                    rerank_options=DOCUMENT_FIRST_RERANK),
    # Each chunk prefilled at ingest behind the chunk-first prompts, so even its first retrieval is a hit.
    "chunk-kv": ModeSpec({**TIERS_ON, **PLACE_OFF}, {"context_first": True, **PLACE_OFF}, chunk_kv=True,
                         rerank_options=DOCUMENT_FIRST_RERANK),
    # The defaults since issue 49: as chunk-kv, and each chunk's KV also computed alone at ingest, so a prompt's
    # chunks after its first are placed rather than prefilled.
    "placed-context-first": ModeSpec({**TIERS_ON, **PLACE_ON}, {"context_first": True, **PLACE_ON}, chunk_kv=True,
                                     rerank_options=DOCUMENT_FIRST_RERANK),
    # Question first, each chunk's KV computed alone at ingest and placed where the prompt puts it (issue 49).
    "placed": ModeSpec({**TIERS_ON, **PLACE_ON}, {**QUESTION_FIRST, **PLACE_ON}, chunk_kv=True,
                       rerank_options=QUERY_FIRST_RERANK),
    # The helper daemon: embeddings and tokenizing only (its judge, document first, is asked of llama-server).
    PEER: ModeSpec({"kv_host_mib": 0, "kv_disk_mib": 0}, rerank_options=DOCUMENT_FIRST_RERANK),
}
RESTART_MODES = ("tiers-context-first", "tiers")  # the restart phase runs the first of these the run has


@dataclass
class RagRepeatOptions:
    """``headrace bench rag-repeat --rag-...``."""

    modes: list[str] = field(default_factory=lambda: list(MODES))
    workflows: list[str] = field(default_factory=lambda: list(WORKFLOWS))
    fractions: list[float] = field(default_factory=lambda: [0.5, 0.8])
    rates: list[float] = field(default_factory=list)  # queries/s, as given (no fraction of the capacity)
    arrivals: int = 60
    min_chunks: int = 200
    zipf: float = 1.1
    probe: int = 3  # warm queries one at a time for the capacity, after one unmeasured
    restart_warm: int = 40  # 0: no restart phase
    restart_queries: int = 20
    max_tokens: int = MAX_TOKENS
    doc_tokens: int = 2000
    drain_s: float = 300.0
    seed: int = 0

    def check(self) -> None:
        unknown = [m for m in self.modes if m not in MODES]
        if unknown:
            raise ValueError(f"unknown rag-repeat mode(s) {unknown}; choose from {', '.join(MODES)}")
        bad = [w for w in self.workflows if w not in WORKFLOWS]
        if bad:
            raise ValueError(f"--rag-workflows: {bad}; choose from {', '.join(WORKFLOWS)}")
        if self.arrivals < 1 or self.min_chunks < 1 or self.probe < 1 or self.restart_queries < 1:
            raise ValueError("--rag-arrivals, --rag-chunks, --rag-probe and --rag-restart-queries must be >= 1")
        if self.restart_warm < 0 or self.zipf <= 0 or any(x <= 0 for x in [*self.fractions, *self.rates]):
            raise ValueError("--rag-restart must be >= 0; --rag-zipf, --rag-fractions and --rag-rates > 0")
        if not self.fractions and not self.rates and not self.restart_warm:
            raise ValueError("rag-repeat needs --rag-fractions or --rag-rates (or only the restart phase: "
                             "--rag-fractions with no value and --rag-restart N)")


def add_arguments(p: Any) -> None:
    """The benchmark's flags on ``headrace bench``'s parser."""
    d = RagRepeatOptions()
    p.add_argument("--rag-modes", nargs="+", default=d.modes, metavar="MODE",
                   help=f"{RAG_REPEAT} modes, each a daemon of its own (default all: {' '.join(MODES)}); with --url "
                        "exactly one, the mode that daemon is in")
    p.add_argument("--rag-workflows", nargs="+", default=d.workflows, metavar="WORKFLOW",
                   help=f"{RAG_REPEAT} workflows (default {' '.join(WORKFLOWS)})")
    p.add_argument("--rag-fractions", type=float, nargs="*",
                   help=f"{RAG_REPEAT} load points as fractions of the capacity engine-cache measures (one over its "
                        "mean single-query latency; default 0.5 0.8 unless --rag-rates; none given and no "
                        "--rag-rates: the restart phase alone)")
    p.add_argument("--rag-rates", type=float, nargs="*", default=[], help=f"{RAG_REPEAT} load points in queries/s")
    p.add_argument("--rag-arrivals", type=int, default=d.arrivals,
                   help=f"Poisson arrivals per {RAG_REPEAT} point (default {d.arrivals})")
    p.add_argument("--rag-chunks", type=int, default=d.min_chunks,
                   help=f"the collection's chunks at least (default {d.min_chunks}; the corpus grows to them)")
    p.add_argument("--rag-zipf", type=float, default=d.zipf, help=f"the topics' Zipf exponent (default {d.zipf})")
    p.add_argument("--rag-probe", type=int, default=d.probe,
                   help=f"warm queries one at a time that measure the capacity (default {d.probe})")
    p.add_argument("--rag-restart", type=int, default=d.restart_warm, metavar="N",
                   help=f"the restart phase's warm-up queries (default {d.restart_warm}; 0: no restart phase)")
    p.add_argument("--rag-restart-queries", type=int, default=d.restart_queries,
                   help=f"the queries timed after the restart (default {d.restart_queries})")
    p.add_argument("--rag-max-tokens", type=int, default=d.max_tokens,
                   help=f"{RAG_REPEAT}'s answer length (default {d.max_tokens})")


def options_from(args: Any) -> RagRepeatOptions | str:
    """The options from ``headrace bench``'s flags, or what is wrong with them."""
    fractions = args.rag_fractions
    if fractions is None:
        fractions = [] if args.rag_rates else [0.5, 0.8]
    opts = RagRepeatOptions(modes=list(dict.fromkeys(args.rag_modes)), workflows=list(dict.fromkeys(args.rag_workflows)),
                            fractions=fractions, rates=args.rag_rates, arrivals=args.rag_arrivals,
                            min_chunks=args.rag_chunks, zipf=args.rag_zipf, probe=args.rag_probe,
                            restart_warm=args.rag_restart, restart_queries=args.rag_restart_queries,
                            max_tokens=args.rag_max_tokens, doc_tokens=args.doc_tokens,
                            drain_s=300.0 if args.drain is None else args.drain, seed=args.seed)
    try:
        opts.check()
    except ValueError as exc:
        return str(exc)
    others = [w for w in args.workloads if w != RAG_REPEAT]
    if others:
        return f"{RAG_REPEAT} runs alone (it starts a daemon per mode): drop {' '.join(others)}"
    if args.url and len(opts.modes) != 1:
        return f"with --url, --rag-modes names the one mode that daemon is in (got {' '.join(opts.modes)})"
    if args.url and opts.modes[0] == PEER:
        return f"the {PEER} mode starts llama-server itself: run it without --url"
    return opts


# The workload ------------------------------------------------------------------------------------------------


# One query, streamed ------------------------------------------------------------------------------------------


@dataclass
class Answer:
    """What one query came to."""

    index: int
    latency_s: float | None = None
    ttft_s: float | None = None  # the final answer's first token, from the request's start
    answer: str | None = None
    error: str | None = None
    # The peer's own token counts (its usage and timings); a headrace mode's come from /metrics per point.
    prompt_tokens: int = 0
    prefilled_tokens: int = 0


async def run_streamed(daemon: Daemon, workflow: str, inputs: dict[str, Any], config: dict[str, Any],
                       record: Answer) -> None:
    """One run with ``stream: true``: its latency, the final answer's first token, the answer."""
    t0 = time.perf_counter()
    event, result = "", None
    body = {"inputs": inputs, "config": config, "stream": True}
    async with daemon.http.stream("POST", f"/v1/workflows/{workflow}/runs", json=body) as response:
        if response.status_code >= 400:
            raise BenchError(f"{workflow}: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                event = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                if event == "node.partial" and data.get("delta") and record.ttft_s is None:
                    record.ttft_s = time.perf_counter() - t0
                elif event == "run.finished":
                    result = data.get("result") or {}
                elif event == "run.failed":
                    raise BenchError(f"{workflow} run {data.get('run')} {data.get('status')}: {data.get('error')}")
    if result is None:
        raise BenchError(f"{workflow}: the stream ended without run.finished")
    record.latency_s = time.perf_counter() - t0
    record.answer = str(result.get("answer", ""))
    if record.ttft_s is None:  # an empty answer streams no token: its first token is its end
        record.ttft_s = record.latency_s


class Target:
    """Where a mode's queries go: the workflow server-side (a headrace mode), or the peer's client pipeline."""

    def __init__(self, daemon: Daemon, workflow: str, config: dict[str, Any], peer: Any = None) -> None:
        self.daemon, self.workflow, self.config, self.peer = daemon, workflow, config, peer

    async def ask(self, query: Query, record: Answer) -> None:
        if self.peer is not None:
            await self.peer.run(self.workflow, query.text, self.config, record)
        else:
            await run_streamed(self.daemon, self.workflow, {"question": query.text, "collection": COLLECTION},
                               self.config, record)


async def one_at_a_time(target: Target, queries: list[Query]) -> list[Answer]:
    out = []
    for q in queries:
        record = Answer(q.index)
        await target.ask(q, record)
        out.append(record)
    return out


def point_summary(records: list[Answer], result: Any, tokens: dict[str, Any] | None) -> dict[str, Any]:
    done = [r for r in records if r.latency_s is not None]
    lat = sorted(r.latency_s for r in done)
    ttft = sorted(r.ttft_s for r in done if r.ttft_s is not None)
    out = {"arrivals": len(records), "completed": len(done), "mean_s": statistics.fmean(lat) if lat else None,
           "p95_s": percentile(lat, 95), "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
           "ttft_p95_s": percentile(ttft, 95), "makespan_s": result.makespan if result is not None else None,
           "errors": sorted({r.error for r in records if r.error})[:3],
           "answers": [r.answer for r in records], "latencies_s": [r.latency_s for r in records]}
    if tokens is None:  # the peer: its own usage per call
        tokens = {"prompt_tokens": float(sum(r.prompt_tokens for r in done)),
                  "prefilled_tokens": float(sum(r.prefilled_tokens for r in done)), "cached_source": "usage"}
        tokens["cached_tokens"] = tokens["prompt_tokens"] - tokens["prefilled_tokens"]
    n = max(1, len(done))
    out["tokens"] = tokens
    out["prompt_per_query"] = tokens["prompt_tokens"] / n
    out["prefilled_per_query"] = tokens["prefilled_tokens"] / n
    return out


async def load_point(target: Target, queries: list[Query], rate: float, seed: int, drain_s: float,
                     llm: str | None) -> dict[str, Any]:
    """``queries`` as seeded Poisson arrivals at ``rate``; the metrics read around them (headrace modes)."""
    records = [Answer(q.index) for q in queries]
    before = await target.daemon.metrics() if llm else ""

    async def request(i: int) -> None:
        try:
            await target.ask(queries[i], records[i])
        except Exception as exc:
            records[i].error = f"{type(exc).__name__}: {exc}"[:300]
            records[i].latency_s = None
            raise

    result = await poisson({"q": request}, rate, 0.0, float(10 ** 9), seed, drain_s, count=len(queries))
    for record, sample in zip(records, result.samples):
        if sample.latency is None:  # cancelled at the drain's end, or failed
            record.latency_s, record.error = None, record.error or sample.error
    tokens = token_counts(before, await target.daemon.metrics(), llm) if llm else None
    return {"rate": rate, **point_summary(records, result, tokens), "questions": [q.text for q in queries]}


# The benchmark ------------------------------------------------------------------------------------------------


@dataclass
class Plan:
    """Everything drawn before any daemon starts: the same in every mode."""

    corpus: Corpus
    warm: list[Query]  # one unmeasured, then the capacity probe's
    points: list[list[Query]]  # per load point (rates decided per workflow)
    restart_warm: list[Query]
    restart_timed: list[Query]


def make_plan(corpus: Corpus, opts: RagRepeatOptions) -> Plan:
    n_points = len(opts.fractions) + len(opts.rates)
    s = opts.seed
    return Plan(corpus, draw_queries(corpus, 1 + opts.probe, opts.zipf, s, salt=1),
                [draw_queries(corpus, opts.arrivals, opts.zipf, s, salt=100 + k) for k in range(n_points)],
                draw_queries(corpus, opts.restart_warm, opts.zipf, s, salt=2),
                draw_queries(corpus, opts.restart_queries, opts.zipf, s, salt=3))


def workflow_config(mode: str, opts: RagRepeatOptions) -> dict[str, Any]:
    return {"max_tokens": opts.max_tokens, **MODES[mode].workflow_config}


class Bench:
    """The whole benchmark: modes x workflows x points, then the restart phase."""

    def __init__(self, config: Path | None, url: str | None, api_key: str, opts: RagRepeatOptions, plan: Plan,
                 log: Callable[[str], None], work: Path) -> None:
        self.config, self.url, self.api_key, self.opts, self.plan, self.log = config, url, api_key, opts, plan, log
        self.work = work
        self.rates: dict[str, list[float]] = {}  # workflow -> its points' rates
        self.capacity: dict[str, dict[str, Any]] = {}
        self.retrieval: dict[str, Any] | None = None  # the workload's popularity, measured once
        self.retriever: Any = None  # the chunks' embeddings, for the peer's client-side search (rag_repeat_peer)
        self.indexed: dict[str, Any] = {}  # the last daemon's indexing: chunks, seconds, chunk KV prefilled

    @contextlib.asynccontextmanager
    async def daemon_for(self, mode: str, tag: str):
        """A daemon in ``mode`` (fresh data dir), its collection indexed; or the --url daemon."""
        if self.url:
            daemon = Daemon(self.url, self.api_key)
            try:
                await self.index(daemon, MODES[mode].chunk_kv)
                yield daemon
            finally:
                with anyio.CancelScope(shield=True), contextlib.suppress(Exception):  # a shared daemon keeps none
                    await daemon.http.delete(f"/v1/collections/{COLLECTION}")
                await daemon.aclose()
            return
        where = self.work / f"{mode}-{tag}"
        where.mkdir(parents=True)
        config = mode_config(self.config, MODES[mode].engine_options, where / "config.toml",
                             MODES[mode].rerank_options)
        with started(config, where / "data", where / "daemon.log") as process:
            daemon = Daemon(process.base_url, process.api_key)
            try:
                await self.index(daemon, MODES[mode].chunk_kv)
                yield daemon
            finally:
                await daemon.aclose()

    async def index(self, daemon: Daemon, chunk_kv: bool = False) -> None:
        t0 = time.perf_counter()
        chunks = await daemon.index_collection(COLLECTION, [d.text for d in self.plan.corpus.documents],
                                               CHUNK_SIZE, CHUNK_OVERLAP, chunk_kv=chunk_kv)
        self.indexed = {"chunks": chunks, "seconds": round(time.perf_counter() - t0, 2),
                        "chunk_kv": daemon.last_ingest.get("chunk_kv")}
        self.log(f"    indexed {len(self.plan.corpus.documents)} documents as {chunks} chunks in "
                 f"{self.indexed['seconds']:.1f}s" + (f"; chunk KV {self.indexed['chunk_kv']}" if chunk_kv else ""))

    async def llm_of(self, daemon: Daemon) -> str:
        kinds = await daemon.models()
        llm = next((m for m, k in kinds.items() if k == "llm"), None)
        if llm is None:
            raise BenchError("the daemon serves no LLM")
        return llm

    async def run_mode(self, mode: str, workflow: str) -> dict[str, Any]:
        spec = MODES[mode]
        if spec.skip:
            self.log(f"  {workflow}, {mode}: skipped: {spec.skip}")
            return {"skipped": spec.skip}
        if mode == PEER:
            from headrace.bench.rag_repeat_peer import peer_mode

            return await peer_mode(self, workflow)
        self.log(f"  {workflow}, {mode}: starting its daemon")
        async with self.daemon_for(mode, workflow) as daemon:
            if self.retrieval is None:
                from headrace.bench.rag_repeat_peer import popularity

                self.retrieval = await popularity(self, daemon)
            out = await self.measure(mode, workflow, Target(daemon, workflow, workflow_config(mode, self.opts)),
                                     await self.llm_of(daemon))
            return {"indexing": self.indexed, **out}

    async def measure(self, mode: str, workflow: str, target: Target, llm: str | None) -> dict[str, Any]:
        """The warm queries (the capacity, measured in the first mode), then each load point."""
        warm = await one_at_a_time(target, self.plan.warm)
        probe = [r.latency_s for r in warm[1:]]
        out: dict[str, Any] = {"warm_s": [r.latency_s for r in warm]}
        if workflow not in self.rates:
            mean = statistics.fmean(probe)
            self.capacity[workflow] = {"mode": mode, "mean_s": mean, "queries_per_s": 1 / mean, "probe_s": probe}
            self.rates[workflow] = [round(f / mean, 4) for f in self.opts.fractions] + list(self.opts.rates)
            self.log(f"    capacity {1 / mean:.4f} queries/s (mean {mean:.2f}s over {len(probe)} warm queries, "
                     f"{mode}): rates {self.rates[workflow]}")
        out["points"] = []
        for k, (rate, queries) in enumerate(zip(self.rates[workflow], self.plan.points)):
            point = await load_point(target, queries, rate, self.opts.seed + k, self.opts.drain_s, llm)
            out["points"].append(point)
            self.log(f"    {rate:g} q/s: {point['completed']}/{point['arrivals']} done, mean {_s(point['mean_s'])} "
                     f"p95 {_s(point['p95_s'])} TTFT {_s(point['ttft_mean_s'])}, prefilled "
                     f"{point['prefilled_per_query']:.0f} of {point['prompt_per_query']:.0f} tokens a query")
        return out

    async def restart_phase(self) -> dict[str, Any] | None:
        """Warm N queries, restart on the same data dir, time the next ones; the same ones on a daemon that was
        warmed alike and not restarted, and on an empty start."""
        mode = next((m for m in RESTART_MODES if m in self.opts.modes), None)
        if self.url or not self.opts.restart_warm or mode is None:
            return None
        workflow = self.opts.workflows[0]
        config = workflow_config(mode, self.opts)
        timed = self.plan.restart_timed
        out: dict[str, Any] = {"mode": mode, "workflow": workflow, "warm_queries": len(self.plan.restart_warm),
                               "timed_queries": len(timed)}
        where = self.work / "restart"
        where.mkdir()
        cfg = mode_config(self.config, MODES[mode].engine_options, where / "config.toml",
                          MODES[mode].rerank_options)
        for case in ("restarted", "warm", "empty"):
            self.log(f"  restart phase, {workflow} in {mode}: {case}")
            data = where / f"data-{case}"
            with started(cfg, data, where / f"{case}.log") as process:
                daemon = Daemon(process.base_url, process.api_key)
                try:
                    await self.index(daemon, MODES[mode].chunk_kv)
                    if case != "empty":
                        await one_at_a_time(Target(daemon, workflow, config), self.plan.restart_warm)
                    if case != "restarted":  # that one is stopped first (its cells' prefixes written to disk)
                        out[case] = await self.timed(daemon, workflow, config, timed)
                finally:
                    await daemon.aclose()
            if case == "restarted":
                with started(cfg, data, where / f"{case}.log") as process:
                    daemon = Daemon(process.base_url, process.api_key)
                    try:  # the collection is on disk already: no index
                        out[case] = await self.timed(daemon, workflow, config, timed)
                    finally:
                        await daemon.aclose()
        return out

    async def timed(self, daemon: Daemon, workflow: str, config: dict[str, Any], queries: list[Query]) -> dict:
        llm = await self.llm_of(daemon)
        before = await daemon.metrics()
        records = await one_at_a_time(Target(daemon, workflow, config), queries)
        summary = point_summary(records, None, token_counts(before, await daemon.metrics(), llm))
        self.log(f"    {len(records)} queries one at a time: mean {_s(summary['mean_s'])}, TTFT "
                 f"{_s(summary['ttft_mean_s'])}, prefilled {summary['prefilled_per_query']:.0f} tokens a query")
        return summary


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}s"


async def rag_repeat_phase(config: Path | None, url: str | None, api_key: str, corpus: Corpus,
                           opts: RagRepeatOptions, log: Callable[[str], None]) -> dict[str, Any]:
    """The benchmark's results (``rag_repeat_report`` writes them)."""
    plan = make_plan(corpus, opts)
    modes = opts.modes if url else sorted(opts.modes, key=lambda m: m != ENGINE_CACHE)  # the capacity first
    with tempfile.TemporaryDirectory(prefix="headrace-rag-repeat-") as tmp:
        bench = Bench(config, url, api_key, opts, plan, log, Path(tmp))
        results: dict[str, Any] = {"workflows": {}}
        try:
            for workflow in opts.workflows if opts.fractions or opts.rates else ():  # none: the restart alone
                rows = results["workflows"][workflow] = {}
                for mode in modes:
                    try:
                        rows[mode] = await bench.run_mode(mode, workflow)
                    except BenchError as exc:  # one mode's failure (a server that died) leaves the others' figures
                        if workflow not in bench.rates:
                            raise  # no capacity, so no point for any mode
                        log(f"  {workflow}, {mode}: failed: {exc}")
                        rows[mode] = {"failed": str(exc)[:2000]}
            try:
                results["restart"] = await bench.restart_phase()
            except BenchError as exc:  # the load points' figures stand without it
                log(f"  restart phase failed: {exc}")
                results["restart"] = {"failed": str(exc)[:2000]}
        except BaseException:
            keep = Path(tempfile.mkdtemp(prefix="headrace-rag-repeat-logs-"))
            for f in Path(tmp).rglob("*.log"):  # the daemons' logs outlive a failure
                shutil.copy(f, keep / f"{f.parent.name}-{f.name}")
            log(f"  the daemons' logs are kept in {keep}")
            raise
    results.update(rates=bench.rates, capacity=bench.capacity, retrieval=bench.retrieval,
                   options={k: v for k, v in vars(opts).items()},
                   collection={"name": COLLECTION, "documents": len(corpus.documents),
                               "chunks": chunk_count([d.text for d in corpus.documents]),
                               "topics": len(topics_of(corpus)), "chunk_size": CHUNK_SIZE,
                               "chunk_overlap": CHUNK_OVERLAP},
                   skipped={m: MODES[m].skip for m in opts.modes if MODES[m].skip})
    return results


def run_command(args: Any, tokenizer: Callable[[str], list]) -> int:
    """``headrace bench rag-repeat``: run it, write results.json and results.txt to ``--out``."""
    from headrace.bench.rag_repeat_report import write

    opts = options_from(args)
    if isinstance(opts, str):
        print(f"headrace bench: {opts}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        corpus = corpus_for(opts.min_chunks, opts.seed, opts.doc_tokens, lambda text: len(tokenizer(text)))
        results = anyio.run(rag_repeat_phase, None if args.url else args.config, args.url, args.api_key, corpus,
                            opts, lambda line: print(line, flush=True))
    except BenchError as exc:
        print(f"headrace bench: {exc}", file=sys.stderr)
        return 2
    from headrace.bench.subcommand import machine

    results["meta"] = {"machine": machine(), "elapsed_s": time.perf_counter() - t0,
                       "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "argv": sys.argv[1:]}
    files, text = write(results, args.out)
    print(text)
    print(f"wrote {', '.join(str(f) for f in files)}")
    return 0


__all__ = ["RAG_REPEAT", "MODES", "RagRepeatOptions", "add_arguments", "run_command", "rag_repeat_phase",
           "token_counts"]
