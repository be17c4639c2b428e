"""``headrace bench soak``: mixed traffic at a steady fraction of capacity for a long time, and what it leaves behind.

Issue 41's soak. One seeded Poisson stream carries every kind of traffic the daemon serves, in ``SHARES``:

- ``chat``: a plain (unstreamed) ``/v1/chat/completions`` call;
- ``responses``: a stored ``/v1/responses`` turn and a second one continuing it (``previous_response_id``): the
  Responses store grows with every pair, as a real deployment's does, within its age limit;
- ``chat_dropped``: a streamed chat the client closes after reading about half its tokens, as a client that goes
  away; it counts as ``dropped``, never as lost, and the daemon must free its work and serve on;
- ``naive_rag``, ``map_reduce_summary``: the built-in workflows over one corpus document, run server-side;
- ``embeddings``: ``/v1/embeddings`` over a few corpus passages;
- ``ingest``: a passage posted into the soak's collection under one of ``INGEST_SLOTS`` ids, so re-posts replace
  chunks and the collection stays the same size however long the soak runs (a growing collection would grow RSS);
- ``query``: ``naive_rag`` over that collection while ingests replace its documents.

The rate is ``fraction`` of the capacity a short closed-loop probe of the same mix measures (or a given rate).
Every ``sample_s`` seconds the daemon process's RSS and open descriptors are read from /proc (``soak_report``);
after the arrivals and the drain, the report computes the issue's criteria: no lost run, no 5xx, RSS growth under
5% after the warm-up, descriptors flat, and nothing left in flight.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import anyio
import httpx

from headrace.bench.client import BenchError, Daemon
from headrace.bench.corpus import Corpus
from headrace.bench.load import arrivals, percentile, poisson
from headrace.bench.phases import LABEL, SAMPLE
from headrace.bench.workloads import WORKLOADS

SOAK = "soak"  # the benchmark's name on the ``headrace bench`` command line
KINDS = ("chat", "chat_dropped", "responses", "naive_rag", "map_reduce_summary", "embeddings", "ingest", "query")
SHARES = {"chat": 0.20, "chat_dropped": 0.10, "responses": 0.05, "naive_rag": 0.15, "map_reduce_summary": 0.10, "embeddings": 0.15,
          "ingest": 0.05, "query": 0.20}
WORKFLOW_OF = {"naive_rag": "naive_rag", "map_reduce_summary": "map_reduce_summary", "query": "naive_rag"}
SOAK_COLLECTION = "soak_corpus"  # its own, so a shared daemon's bench_corpus is left alone
INGEST_SLOTS = 8  # document ids the ingests cycle through
PASSAGE_WORDS = 160  # an ingest's passage; an embeddings call sends it in four pieces
EMBED_PIECES = 4
CHAT_TOKENS = 32  # a chat's answer (and a dropped stream's before its drop), unless --max-tokens
WARMUP_SHARE = 1 / 6  # the RSS criterion counts from min(600 s, this share of the window): 600 s of an hour
WARMUP_CAP_S = 600.0
PROBE_PER_WORKER = 3  # the probe's arrivals in all: this many per closed-loop worker
SETTLE_S = 2.0  # after the traffic's connections close, before the idle sample: the daemon sees the EOFs
DRAIN_POLL_S = 15.0  # how long the daemon may take to free dropped work after the drain

# An arrival's outcome. Only ``lost`` and ``5xx`` fail the soak; a 4xx is the bench's own mistake, reported.
OK, DROPPED, HTTP_4XX, HTTP_5XX, LOST, PENDING = "ok", "dropped", "4xx", "5xx", "lost", "pending"


@dataclass
class SoakOptions:
    """The soak's settings (``headrace bench soak --soak-...``)."""

    seconds: float = 3600.0  # the arrival window
    fraction: float = 0.8  # of the probed capacity
    rate: float | None = None  # arrivals/s as given: no probe
    sample_s: float = 30.0
    pid: int | None = None  # the daemon's process; None: resolved by the command (started, or --soak-pid)
    probe_concurrency: int = 4
    drain_s: float = 300.0  # after the last arrival, how long stragglers may finish before they count as lost
    max_tokens: int | None = None  # every chat's and workflow's output length
    seed: int = 0

    def check(self) -> None:
        if self.seconds <= 0 or self.sample_s <= 0 or self.fraction <= 0:
            raise ValueError("--soak-seconds, --soak-sample-seconds and --soak-fraction must be > 0")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("--soak-rate must be > 0")
        if self.probe_concurrency < 1:
            raise ValueError("--soak-probe must be >= 1")

    @property
    def warmup_s(self) -> float:
        return min(WARMUP_CAP_S, self.seconds * WARMUP_SHARE)


@dataclass(frozen=True)
class SoakArrival:
    """One arrival of the stream: its kind and its inputs, drawn from the seed."""

    index: int
    kind: str
    question: int  # the corpus question (chats, workflow runs, queries)
    document: int  # the corpus document a passage is cut from (embeddings, ingests)
    offset: int  # the passage's first word


@dataclass
class SoakRecord:
    """What one arrival came to."""

    index: int
    kind: str
    arrival_s: float = 0.0
    started: bool = False
    latency_s: float | None = None  # sent to answered (a dropped stream: to its drop)
    status: int | None = None  # the HTTP status; None: no response
    outcome: str = PENDING
    error: str | None = None

    def fail(self, outcome: str, error: str) -> None:
        self.outcome, self.error = outcome, error[:300]


def draw_soak(n: int, corpus: Corpus, seed: int, shares: dict[str, float] = SHARES) -> list[SoakArrival]:
    """``n`` arrivals: the kinds in their exact shares (largest remainder), at least one of each once ``n`` allows,
    shuffled; each one's question and passage at random."""
    exact = {k: n * shares.get(k, 0.0) / sum(shares.values()) for k in KINDS}
    counts = {k: math.floor(x) for k, x in exact.items()}  # the largest remainders get what is left
    for k in sorted(KINDS, key=lambda k: (counts[k] - exact[k], KINDS.index(k)))[:n - sum(counts.values())]:
        counts[k] += 1
    for kind in [k for k in KINDS if shares.get(k) and not counts[k]]:
        biggest = max(counts, key=counts.get)
        if counts[biggest] > 1:  # a short smoke still sends every kind
            counts[biggest] -= 1
            counts[kind] = 1
    rng = random.Random(seed)
    kinds = [k for k, c in counts.items() for _ in range(c)]
    rng.shuffle(kinds)
    out = []
    for i, kind in enumerate(kinds):
        document = rng.randrange(len(corpus.documents))
        words = len(corpus.documents[document].text.split())
        out.append(SoakArrival(i, kind, rng.randrange(len(corpus.questions)), document,
                               rng.randrange(max(1, words - PASSAGE_WORDS))))
    return out


class SoakRunner:
    """Sends one arrival of any kind and records its outcome; never raises for the daemon's answer (the record
    says it), so one bad answer never stops the stream."""

    def __init__(self, daemon: Daemon, llm: str, embedder: str, corpus: Corpus, max_tokens: int | None) -> None:
        self.daemon, self.llm, self.embedder, self.corpus = daemon, llm, embedder, corpus
        self.max_tokens = max_tokens

    async def attempt(self, arrival: SoakArrival, record: SoakRecord) -> None:
        record.started = True
        t0 = time.perf_counter()
        try:
            await getattr(self, f"_{arrival.kind}")(arrival, record)
        except httpx.TransportError as exc:  # no response, or a connection reset mid-answer
            record.fail(LOST, f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # an answer the bench cannot read is not a completed run either
            record.fail(LOST, f"{type(exc).__name__}: {exc}")
        else:
            if record.outcome == PENDING:
                record.outcome = OK
        if record.outcome in (OK, DROPPED):
            record.latency_s = time.perf_counter() - t0

    async def run(self, program: SoakArrival, key: str, record: Any, tools_wait: bool = True) -> None:
        """``mixed_phase.probe_capacity``'s runner interface: raises unless the arrival completed."""
        mine = SoakRecord(program.index, program.kind)
        await self.attempt(program, mine)
        if mine.outcome not in (OK, DROPPED):
            raise BenchError(f"{program.kind}: {mine.outcome}: {mine.error}")
        record.latency_s = mine.latency_s

    # One method per kind -------------------------------------------------------------------------------------

    def _question(self, arrival: SoakArrival) -> str:
        return f"({arrival.index}) {self.corpus.questions[arrival.question].text}"

    def _passage(self, arrival: SoakArrival) -> list[str]:
        words = self.corpus.documents[arrival.document].text.split()
        return words[arrival.offset:arrival.offset + PASSAGE_WORDS]

    async def _post(self, record: SoakRecord, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """The answer's JSON; None when it was a 4xx or 5xx (recorded)."""
        response = await self.daemon.http.post(path, json=body)
        record.status = response.status_code
        if response.status_code >= 400:
            record.fail(HTTP_5XX if response.status_code >= 500 else HTTP_4XX,
                        f"POST {path}: HTTP {response.status_code}: {response.text[:200]}")
            return None
        return response.json()

    async def _chat(self, arrival: SoakArrival, record: SoakRecord) -> None:
        body = await self._post(record, "/v1/chat/completions", {
            "model": self.llm, "messages": [{"role": "user", "content": self._question(arrival)}],
            "max_tokens": self.max_tokens or CHAT_TOKENS, "temperature": 0})
        if body is not None and not body["choices"][0].get("finish_reason"):
            record.fail(LOST, f"chat answered without a finish_reason: {json.dumps(body)[:200]}")

    async def _responses(self, arrival: SoakArrival, record: SoakRecord) -> None:
        turn = {"model": self.llm, "max_output_tokens": self.max_tokens or CHAT_TOKENS, "temperature": 0}
        first = await self._post(record, "/v1/responses", {**turn, "input": self._question(arrival)})
        if first is None or not self._answered(record, first, "first"):
            return
        second = await self._post(record, "/v1/responses", {**turn, "input": "Say it again in one short sentence.",
                                                            "previous_response_id": first["id"]})
        if second is not None:
            self._answered(record, second, "continued")

    @staticmethod
    def _answered(record: SoakRecord, body: dict[str, Any], turn: str) -> bool:
        """Whether a response ended (``incomplete``: at ``max_output_tokens``); if not, the arrival is lost."""
        if body.get("status") in ("completed", "incomplete") and body.get("output"):
            return True
        record.fail(LOST, f"{turn} response {body.get('id')} {body.get('status')}: {json.dumps(body)[:200]}")
        return False

    async def _chat_dropped(self, arrival: SoakArrival, record: SoakRecord) -> None:
        tokens = self.max_tokens or CHAT_TOKENS
        body = {"model": self.llm, "messages": [{"role": "user", "content": self._question(arrival)}],
                "max_tokens": tokens, "temperature": 0, "stream": True}
        read, done = 0, False
        async with self.daemon.http.stream("POST", "/v1/chat/completions", json=body) as response:
            record.status = response.status_code
            if response.status_code >= 400:
                await response.aread()
                record.fail(HTTP_5XX if response.status_code >= 500 else HTTP_4XX,
                            f"chat stream: HTTP {response.status_code}: {response.text[:200]}")
                return
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                    break
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    record.fail(LOST, f"chat stream failed: {event['error']}")
                    return
                if (event.get("choices") or [{}])[0].get("delta", {}).get("content"):
                    read += 1
                if read >= max(1, tokens // 2):
                    record.outcome = DROPPED
                    break
        # Leaving the block closes the response unread: the connection goes, as a client that walks away.
        if record.outcome != DROPPED and not done:
            record.fail(LOST, f"chat stream ended after {read} tokens without [DONE]")

    async def _workflow(self, arrival: SoakArrival, record: SoakRecord, inputs: dict[str, Any]) -> None:
        workflow = WORKFLOW_OF[arrival.kind]
        config = dict(WORKLOADS[workflow].config)
        if self.max_tokens is not None:
            config["max_tokens"] = self.max_tokens
        body = await self._post(record, f"/v1/workflows/{workflow}/runs", {"inputs": inputs, "config": config})
        if body is not None and body.get("status") != "succeeded":
            record.fail(LOST, f"{workflow} run {body.get('id')} {body.get('status')}: {body.get('error')}")

    async def _naive_rag(self, arrival: SoakArrival, record: SoakRecord) -> None:
        await self._workflow(arrival, record, WORKLOADS["naive_rag"].inputs(self.corpus, arrival.question))

    async def _map_reduce_summary(self, arrival: SoakArrival, record: SoakRecord) -> None:
        await self._workflow(arrival, record, WORKLOADS["map_reduce_summary"].inputs(self.corpus, arrival.question))

    async def _query(self, arrival: SoakArrival, record: SoakRecord) -> None:
        await self._workflow(arrival, record, {"question": self.corpus.questions[arrival.question].text,
                                               "collection": SOAK_COLLECTION})

    async def _embeddings(self, arrival: SoakArrival, record: SoakRecord) -> None:
        words = self._passage(arrival)
        size = max(1, len(words) // EMBED_PIECES)
        pieces = [" ".join(words[i:i + size]) for i in range(0, len(words), size)][:EMBED_PIECES]
        body = await self._post(record, "/v1/embeddings", {"model": self.embedder, "input": pieces})
        if body is not None and len(body.get("data", [])) != len(pieces):
            record.fail(LOST, f"embeddings: {len(body.get('data', []))} vectors for {len(pieces)} inputs")

    async def _ingest(self, arrival: SoakArrival, record: SoakRecord) -> None:
        doc_id = f"soak-{arrival.index % INGEST_SLOTS}"
        body = await self._post(record, f"/v1/collections/{SOAK_COLLECTION}/documents",
                                {"documents": [{"id": doc_id, "text": " ".join(self._passage(arrival))}]})
        if body is not None and doc_id not in body.get("ids", []):
            record.fail(LOST, f"ingest: {doc_id} not among the ids answered: {json.dumps(body)[:200]}")


# The phase -------------------------------------------------------------------------------------------------------


async def soak_phase(systems: Any, corpus: Corpus, opts: SoakOptions, log: Callable[[str], None]) -> dict[str, Any]:
    """The whole soak against ``systems``' daemon (a ``harness.Systems``, not started yet); ``opts.pid`` set."""
    from headrace.bench.soak_report import ProcWatch, criteria, growth_net_of_host_tier
    from headrace.graph.workflows.common import CHUNK_CONFIG

    try:
        opts.check()
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    watch = ProcWatch(opts.pid)  # an unreadable process fails here, before anything runs
    await systems.start()
    missing = [kind for kind in ("llm", "embed") if kind not in systems.models]
    if missing:
        raise BenchError(f"the soak needs an LLM and an embedding engine; the daemon has no {' or '.join(missing)}")
    control = systems.daemon
    llm, embedder = systems.models["llm"], systems.models["embed"]
    out: dict[str, Any] = {"seconds": opts.seconds, "sample_s": opts.sample_s, "warmup_s": opts.warmup_s,
                           "pid": opts.pid, "shares": SHARES, "fraction": None if opts.rate else opts.fraction,
                           "drain_s": opts.drain_s, "seed": opts.seed, "max_tokens": opts.max_tokens}
    chunks = await control.index_collection(SOAK_COLLECTION, [d.text for d in corpus.documents],
                                            CHUNK_CONFIG["chunk_size"]["default"],
                                            CHUNK_CONFIG["chunk_overlap"]["default"])
    out["collection"] = {"name": SOAK_COLLECTION, "chunks": chunks, "ingest_slots": INGEST_SLOTS}
    try:
        # Warm-up and probe on a client of their own, closed before the first sample: its idle connections
        # would otherwise count among the daemon's descriptors at the start.
        async with _traffic(control) as daemon:
            runner = SoakRunner(daemon, llm, embedder, corpus, opts.max_tokens)
            await warm_up(runner, draw_soak(len(KINDS), corpus, opts.seed + 2))
            rate = opts.rate
            if rate is None:
                from headrace.bench.mixed_phase import probe_capacity

                probe = draw_soak(opts.probe_concurrency * PROBE_PER_WORKER, corpus, opts.seed + 1)
                out["capacity"] = await probe_capacity(runner, probe, opts.probe_concurrency, "soak-probe")
                rate = opts.fraction * out["capacity"]["programs_per_s"]
                log(f"  soak capacity: {out['capacity']['programs_per_s']:.4f} arrivals/s "
                    f"({out['capacity']['concurrency']} at once in a closed loop)")
        times = arrivals(rate, opts.seconds, opts.seed)
        if not times:
            raise BenchError(f"no arrival in {opts.seconds:g} s at {rate:.4g}/s: raise --soak-seconds or the rate")
        plan = draw_soak(len(times), corpus, opts.seed)
        out.update(rate=rate, arrivals=len(plan), mix={k: sum(a.kind == k for a in plan) for k in KINDS})
        log(f"  soak: {len(plan)} arrivals over {opts.seconds:g} s at {rate:.4f}/s, a sample every "
            f"{opts.sample_s:g} s (" + ", ".join(f"{n} {k}" for k, n in out["mix"].items()) + ")")
        records, samples, daemon_side = await run_stream(control, watch, corpus, plan, rate, opts, llm, embedder,
                                                         log)
    finally:
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):  # a shared daemon keeps no leftovers
            await control.http.delete(f"/v1/collections/{SOAK_COLLECTION}")
    out["kinds"], out["totals"] = summarize(records)
    out["errors"] = sorted({f"{r.kind}: {r.error}" for r in records if r.error})[:5]
    out["samples"], out["daemon"] = samples, daemon_side
    out["criteria"] = criteria(samples, out["totals"], opts.warmup_s, daemon_side["in_flight_after_drain"])
    out["rss_net_of_host_tier"] = growth_net_of_host_tier(samples, opts.warmup_s)
    return out


@contextlib.asynccontextmanager
async def _traffic(control: Daemon):
    daemon = Daemon(control.base_url, control.api_key)
    try:
        yield daemon
    finally:
        await daemon.aclose()


async def warm_up(runner: SoakRunner, plan: list[SoakArrival]) -> None:
    """One arrival of each kind at once, unmeasured: engines and workflows warm, and a kind that cannot run at all
    stops the soak here, said plainly, instead of an hour of errors."""
    records = [SoakRecord(a.index, a.kind) for a in plan]
    async with anyio.create_task_group() as tg:
        for arrival, record in zip(plan, records):
            tg.start_soon(runner.attempt, arrival, record)
    bad = [r for r in records if r.outcome not in (OK, DROPPED)]
    if bad:
        raise BenchError(f"the soak's warm-up failed: {bad[0].kind}: {bad[0].outcome}: {bad[0].error}")


async def run_stream(control: Daemon, watch: Any, corpus: Corpus, plan: list[SoakArrival], rate: float,
                     opts: SoakOptions, llm: str, embedder: str,
                     log: Callable[[str], None]) -> tuple[list[SoakRecord], list[dict[str, Any]], dict[str, Any]]:
    """The arrivals with a sampler beside them, the drain, then the idle sample and the daemon's own counts."""
    records = [SoakRecord(a.index, a.kind) for a in plan]
    samples: list[dict[str, Any]] = []
    await anyio.sleep(SETTLE_S)  # the warm-up's and probe's connections closed: the start is idle too
    before = await control.metrics()
    t0 = time.perf_counter()

    async def sample(phase: str, metrics: str | None = None) -> dict[str, Any]:
        row = {"t_s": round(time.perf_counter() - t0, 1), "phase": phase, **watch.read(), **progress(records)}
        text = metrics if metrics is not None else await control.metrics()
        row.update(host_tier(text))
        row.update(malloc_state(text))
        row.update(bounded_caches(text))
        samples.append(row)
        return row

    async def sampler() -> None:
        k = 1
        while True:
            await anyio.sleep(max(0.0, t0 + k * opts.sample_s - time.perf_counter()))
            row = await sample("load")
            log(f"    {row['t_s']:7.0f}s  RSS {row['rss_mib']} MiB (host KV tier {row['host_tier_mib']} MiB, malloc "
                f"{row['malloc_in_use_mib']} in use, {row['malloc_free_mib']} free)  fds "
                f"{row['fds']}  {row['completed']}/{row['arrived']} done, {row['in_flight']} in flight, "
                f"{row['errors']} errors")
            k += 1

    async with _traffic(control) as daemon:
        runner = SoakRunner(daemon, llm, embedder, corpus, opts.max_tokens)

        async def arrival(i: int) -> None:
            await runner.attempt(plan[i], records[i])

        await sample("start", before)  # idle: before the first arrival
        async with anyio.create_task_group() as tg:
            tg.start_soon(sampler)
            result = await poisson({"arrival": arrival}, rate, 0.0, 0.0, opts.seed, opts.drain_s, count=len(plan))
            tg.cancel_scope.cancel()
    for record, s in zip(records, result.samples):  # poisson cancels what the drain did not see finish
        record.arrival_s = round(s.arrival, 3)
        if s.error and record.outcome == PENDING:
            record.fail(LOST, s.error)
    await anyio.sleep(SETTLE_S)
    in_flight = await wait_idle(control)
    after = await control.metrics()
    await sample("idle", after)  # the traffic's connections closed, the drain over: what stayed open stays open
    from headrace.bench.mixed_phase import workflow_runs

    daemon_side = {"workflow_runs": workflow_runs(before, after),
                   "aborted_requests": int(metric_delta(before, after, "headrace_request_success_total",
                                                        finished_reason="abort")),
                   "request_errors": int(metric_delta(before, after, "headrace_request_errors_total")),
                   "in_flight_after_drain": in_flight, "makespan_s": result.makespan}
    return records, samples, daemon_side


def progress(records: list[SoakRecord]) -> dict[str, int]:
    """The stream's counts so far, for a sample."""
    arrived = sum(r.started for r in records)
    completed = sum(r.outcome in (OK, DROPPED) for r in records)
    errors = sum(r.outcome in (HTTP_4XX, HTTP_5XX, LOST) for r in records)
    return {"arrived": arrived, "completed": completed, "errors": errors,
            "in_flight": arrived - completed - errors, "lost": sum(r.outcome == LOST for r in records),
            "http_5xx": sum(r.outcome == HTTP_5XX for r in records)}


def host_tier(text: str) -> dict[str, float]:
    """What the host-memory KV tiers hold and may hold, in MiB (``/metrics`` text): a cache that fills to its budget
    over the soak, so its bytes are part of the RSS growth but not a leak; the report gives the growth net of it."""
    mib = 1024 * 1024
    return {"host_tier_mib": round(metric_sum(text, "headrace_kv_tier_bytes", tier="host") / mib, 1),
            "host_tier_budget_mib": round(metric_sum(text, "headrace_kv_tier_capacity_bytes", tier="host") / mib, 1)}


def malloc_state(text: str) -> dict[str, float | None]:
    """malloc's heaps in MiB (``/metrics`` text): what is in use, and the heaps' free blocks (resident only until a
    trim returns their pages); None without glibc. Says whether what grows is live memory."""
    if "headrace_malloc_bytes" not in text:
        return {"malloc_in_use_mib": None, "malloc_free_mib": None}
    mib = 1024 * 1024
    return {f"malloc_{state}_mib": round(metric_sum(text, "headrace_malloc_bytes", state=state) / mib, 1)
            for state in ("in_use", "free")}


def bounded_caches(text: str) -> dict[str, float]:
    """The bounded caches besides the tier that fill after the first minutes (``/metrics`` text): the finished runs
    kept (MiB as measured, and how many), the prefix cache's share of its token budget (its KV cells' pages) and the
    vector store's session caches (MiB; in the samples, not the table)."""
    mib = 1024 * 1024
    return {"run_history_mib": round(metric_sum(text, "headrace_run_history_bytes") / mib, 1),
            "store_cache_mib": round(metric_sum(text, "headrace_vector_store_cache_bytes") / mib, 2),
            "run_history_runs": int(metric_sum(text, "headrace_run_history_runs")),
            "prefix_cache_perc": round(100 * metric_sum(text, "headrace_prefix_cache_usage_perc"), 1)}


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``, in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and m["name"] == name:
            have = dict(LABEL.findall(m["labels"] or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                total += float(m["value"])
    return total


def metric_delta(before: str, after: str, name: str, **labels: str) -> float:
    return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)


async def wait_idle(control: Daemon) -> dict[str, Any]:
    """The daemon's requests running and waiting, polled until both are 0 or ``DRAIN_POLL_S`` passed: a dropped
    stream's decode is freed at the engine's next step, not at once."""
    t0 = time.perf_counter()
    while True:
        text = await control.metrics()
        running = int(metric_sum(text, "headrace_num_requests_running"))
        waiting = int(metric_sum(text, "headrace_num_requests_waiting"))
        waited = time.perf_counter() - t0
        if (running == 0 and waiting == 0) or waited >= DRAIN_POLL_S:
            return {"running": running, "waiting": waiting, "waited_s": round(waited, 2)}
        await anyio.sleep(0.5)


def summarize(records: list[SoakRecord]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Per kind and in all: arrivals and their outcomes, and the completed ones' latencies."""
    def stats(mine: list[SoakRecord]) -> dict[str, Any]:
        xs = sorted(r.latency_s for r in mine if r.outcome == OK and r.latency_s is not None)
        return {"arrivals": len(mine), **{o: sum(r.outcome == o for r in mine) for o in (OK, DROPPED, HTTP_4XX,
                                                                                         HTTP_5XX, LOST)},
                "mean_s": statistics.fmean(xs) if xs else None, "p95_s": percentile(xs, 95),
                "max_s": xs[-1] if xs else None}

    kinds = {kind: stats([r for r in records if r.kind == kind]) for kind in KINDS}
    return kinds, stats(records)


__all__ = ["SOAK", "KINDS", "SoakOptions", "SoakRunner", "draw_soak", "soak_phase"]
