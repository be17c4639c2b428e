"""The ``mixed`` benchmark's phase: capacity probe, Poisson load points per mode over the program mix, its figures.

The machinery it shares with the agents benchmark (``phases``) does the rest: the modes are the agents'
modes, switched by ``use_mode`` (LLM policy, prefix cache emptied, retention), the ratios are against their
base mode (``per-request``), the metric deltas and the figures' format are its helpers.

Capacity is measured, not assumed: a closed loop of ``probe_concurrency`` programs from the mix (each
worker starting the next as soon as its last ends; client agents' tools instant) in the base mode
counts the programs finished while every worker was busy, per second. The window ends with the
first worker out of work, so the figure leans to the short programs finished in it; it is a scale
for the load points, and each point reports the throughput it actually got. A point is
``programs`` Poisson arrivals at a fraction of it (or at a rate given), the same arrivals and
programs in every mode.

Per point and mode: program latency (its first request sent to its last answer read, a client
agent's tool time included) mean, p50, p95 and max, overall and per kind; completed/total;
throughput (programs finished over the window from the first arrival to the last finish, so
"equal throughput" can be checked between modes); the oldest waits (the longest programs, with
their kind and arrival, and a client agent's longest turn); the prefix cache's hit rate and tokens
prefilled per program (the daemon's prompt tokens less its hits); the daemon's request count.
"""

from __future__ import annotations

import statistics
import time
import uuid
from typing import Any, Callable

import anyio

from headrace.bench.agents import BASE_MODE, AgentClient, build_prompts
from headrace.bench.client import BenchError
from headrace.bench.corpus import Corpus
from headrace.bench.load import percentile, poisson
from headrace.bench.mixed import KINDS, MixedOptions, MixProgram, MixRunner, ProgramRecord, draw_mix, quotas
from headrace.bench.phases import E2E, LABEL, SAMPLE, daemon_tokenizer, deltas, fmt, measure_point, use_mode
from headrace.bench.workloads import BENCH_COLLECTION

RESULTS_KEY = "mixed_programs"  # ``mixed`` is the --mixed-rate load's


async def mixed_programs_phase(systems: Any, corpus: Corpus, opts: MixedOptions,
                               log: Callable[[str], None]) -> dict[str, Any]:
    """The whole benchmark against ``systems``' daemon (a started ``harness.Systems``)."""
    try:
        opts.check()
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    shape = opts.shape
    if "llm" not in systems.models:
        raise BenchError("the mixed benchmark needs an LLM engine")
    if "embed" not in systems.models and any(shape.shares.get(k) for k in ("naive_rag", "agent")):
        raise BenchError("the mixed benchmark's naive_rag and agent programs need an embedding engine")
    daemon, llm = systems.daemon, systems.models["llm"]
    system, snippets, sizes = await build_prompts(corpus, shape.agents, *daemon_tokenizer(systems), seed=opts.seed)
    programs = draw_mix(opts.programs, shape, corpus, snippets, opts.seed)
    run_tag = uuid.uuid4().hex[:8]  # program ids never repeat across runs: the daemon keeps attained service
    out: dict[str, Any] = {"shape": {"name": shape.name, "shares": shape.shares, "chat_tokens": shape.chat_tokens,
                                     "agent_steps": shape.agent_steps, "client_agent_turns": shape.agents.turns,
                                     "tool_s": shape.agents.tool_s, "workflow_tokens": shape.workflow_tokens,
                                     **sizes},
                           "mix": quotas(shape.shares, opts.programs), "modes": list(opts.modes),
                           "programs": opts.programs, "seed": opts.seed, "drain_s": opts.drain_s, "points": []}
    log(f"  mixed ({shape.name}): {opts.programs} programs per point ("
        + ", ".join(f"{n} {k}" for k, n in out["mix"].items() if n) + f"), modes {', '.join(opts.modes)}")
    if shape.shares.get("agent"):  # the traced agents search the corpus, indexed once
        from headrace.graph.workflows.common import CHUNK_CONFIG

        out["collection_chunks"] = await daemon.index_collection(
            BENCH_COLLECTION, [d.text for d in corpus.documents], CHUNK_CONFIG["chunk_size"]["default"],
            CHUNK_CONFIG["chunk_overlap"]["default"])
    client = AgentClient(daemon.base_url, daemon.api_key, llm, shape.agents, system)
    runner = MixRunner(daemon, llm, corpus, system, client, shape.workflow_tokens)
    base_restore: dict[str, Any] = {}
    try:
        base_restore = await use_mode(systems, BASE_MODE, {})  # the warm-up and the probe run in it
        warm = draw_mix(len(KINDS), shape, corpus, snippets, opts.seed + 2)
        await warm_up(runner, client, warm, f"bench-{run_tag}-warm")
        capacity = None
        if opts.fractions:
            probe = draw_mix(shape.probe_programs, shape, corpus, snippets, opts.seed + 1)
            out["capacity"] = await probe_capacity(runner, probe, opts.probe_concurrency or shape.probe_concurrency,
                                                   f"bench-{run_tag}-probe")
            capacity = out["capacity"]["programs_per_s"]
            log(f"    capacity: {capacity:.4f} programs/s ({out['capacity']['concurrency']} at once in a closed loop)")
        points = [{"fraction": f, "rate": round(f * capacity, 5)} for f in opts.fractions] + \
                 [{"fraction": None, "rate": r} for r in opts.rates]
        for p, point in enumerate(points):
            out["points"].append(await measure_point(
                systems, opts.modes, p, point,
                lambda mode: run_point(systems, runner, programs, point["rate"], opts, f"bench-{run_tag}-p{p}-{mode}"),
                lambda mode, row: log(f"    mixed {point['rate']:g}/s, {mode}: " + point_line(row)), ratios))
    finally:
        await client.aclose()
        await use_mode(systems, None, base_restore)  # the daemon's own settings again (a shared daemon serves on)
    return out


async def warm_up(runner: MixRunner, client: AgentClient, programs: list[MixProgram], key: str) -> None:
    """One program of each kind at once, unmeasured: grammars compiled, engines and workflows warm."""
    agent = next((p.agent for p in programs if p.agent is not None), None)
    if agent is not None:
        await client.warm_up(agent.task)
    try:
        async with anyio.create_task_group() as tg:
            for p in programs:
                tg.start_soon(runner.run, p, f"{key}-{p.index}", ProgramRecord(p.index, p.kind), False)
    except Exception as exc:  # a kind that cannot run at all stops the benchmark here, said plainly
        first = exc.exceptions[0] if isinstance(exc, ExceptionGroup) else exc
        raise BenchError(f"the mixed benchmark's warm-up failed: {type(first).__name__}: {first}"[:500]) from exc


async def probe_capacity(runner: MixRunner, probe: list[MixProgram], concurrency: int, key: str) -> dict[str, Any]:
    """Programs per second at saturation: programs finished while all ``concurrency`` closed-loop workers were busy,
    per second."""
    queue = iter(probe)
    done: list[str] = []
    errors: list[str] = []
    window: dict[str, float] = {}
    t0 = time.perf_counter()

    async def worker() -> None:
        for program in queue:
            try:
                await runner.run(program, f"{key}-{program.index}", ProgramRecord(program.index, program.kind),
                                 tools_wait=False)
                done.append(program.kind)
            except Exception as exc:  # counted; a probe that finishes nothing stops the benchmark below
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
        if not window:  # the first worker out of work ends the window in which all were busy
            window.update(seconds=time.perf_counter() - t0, programs=len(done))

    concurrency = min(concurrency, len(probe))
    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(worker)
    elapsed = time.perf_counter() - t0
    if not done:
        raise BenchError(f"the capacity probe's programs all failed: {errors[:1]}")
    per_s = window["programs"] / window["seconds"] if window["programs"] else len(done) / elapsed
    return {"concurrency": concurrency, "programs": len(probe), "finished": len(done), "failed": len(errors),
            "errors": errors[:3], "window_s": window["seconds"], "window_programs": window["programs"],
            "programs_per_s": per_s, "elapsed_s": elapsed, "whole_programs_per_s": len(done) / elapsed}


async def run_point(systems: Any, runner: MixRunner, programs: list[MixProgram], rate: float, opts: MixedOptions,
                    key: str) -> dict[str, Any]:
    records = [ProgramRecord(p.index, p.kind) for p in programs]

    async def program(i: int) -> None:
        await runner.run(programs[i], f"{key}-{i}", records[i])

    before = await systems.daemon.metrics()
    result = await poisson({"program": program}, rate, 0.0, 0.0, opts.seed, opts.drain_s, count=len(programs))
    after = await systems.daemon.metrics()
    delta = deltas(before, after, systems.models["llm"])
    for record, sample in zip(records, result.samples):  # poisson records failures and cancelled stragglers
        record.error = sample.error
        if sample.error:
            record.latency_s = None
    row = summarize(programs, records, [s.arrival for s in result.samples], result.rate, delta)
    row["daemon_workflow_runs"] = workflow_runs(before, after)
    return row


def workflow_runs(before: str, after: str) -> dict[str, dict[str, int]]:
    """Workflow -> status -> runs the daemon ended between two /metrics texts (``headrace_workflow_runs``)."""
    def runs(text: str) -> dict[tuple[str, str], float]:
        out = {}
        for line in text.splitlines():
            m = SAMPLE.match(line)
            if m and m["name"] == "headrace_workflow_runs_total":
                labels = dict(LABEL.findall(m["labels"] or ""))
                out[(labels.get("workflow", ""), labels.get("status", ""))] = float(m["value"])
        return out

    old, new = runs(before), runs(after)
    out: dict[str, dict[str, int]] = {}
    for (workflow, status), value in new.items():
        if value - old.get((workflow, status), 0.0) > 0:
            out.setdefault(workflow, {})[status] = int(value - old.get((workflow, status), 0.0))
    return out


def _stats(latencies: list[float], arrivals: int) -> dict[str, Any]:
    xs = sorted(latencies)
    return {"arrivals": arrivals, "completed": len(xs), "mean_s": statistics.fmean(xs) if xs else None,
            "p50_s": percentile(xs, 50), "p95_s": percentile(xs, 95), "max_s": xs[-1] if xs else None}


def summarize(programs: list[MixProgram], records: list[ProgramRecord], arrivals: list[float], rate: float,
              delta: dict[tuple[str, str], float]) -> dict[str, Any]:
    done = [(r, at) for r, at in zip(records, arrivals) if r.latency_s is not None]
    kinds = {}
    for kind in KINDS:
        mine = [r for r in records if r.kind == kind]
        if mine:
            kinds[kind] = _stats([r.latency_s for r in mine if r.latency_s is not None], len(mine))
    # Throughput over the window the programs were in the system: first arrival to last finish.
    window = max((at + r.latency_s for r, at in done), default=0.0) - (arrivals[0] if arrivals else 0.0)
    prompt = delta.get(("headrace_prompt_tokens_total", ""), 0.0)
    queries = delta.get(("headrace_prefix_cache_queries_total", ""), 0.0)
    hits = delta.get(("headrace_prefix_cache_hits_total", ""), 0.0)
    # Not prefilled: found in the cells (a prefix or a program's retained context) or restored from a KV tier.
    cached = delta.get(("headrace_prompt_cached_tokens_total", ""), hits)
    turns = sorted(((r.index, t, s) for r in records for t, s in enumerate(r.turns)), key=lambda x: -x[2])
    return {
        "rate": rate, **_stats([r.latency_s for r, _ in done], len(records)),
        "errors": sorted({r.error for r in records if r.error})[:3], "kinds": kinds,
        "window_s": window, "throughput": len(done) / window if window > 0 else None,
        "daemon_requests": int(delta.get((f"{E2E}_count", ""), 0.0)),
        "client_agent_turns": sum(len(r.turns) for r in records),
        "client_agent_turns_planned": sum(p.agent.turns for p in programs if p.agent is not None),
        "prefix_queries": int(queries), "prefix_hits": int(hits), "hit_rate": hits / queries if queries else None,
        "daemon_prompt_tokens": int(prompt), "cached_tokens": int(cached), "tokens_prefilled": int(prompt - cached),
        "prefilled_per_program": (prompt - cached) / len(records) if records else None,
        # The oldest waits: the slowest programs, and the longest one client-agent turn waited for its answer.
        "longest_programs": [{"program": r.index, "kind": r.kind, "size": programs[r.index].size(),
                              "arrival_s": round(at, 3), "seconds": round(r.latency_s, 3)}
                             for r, at in sorted(done, key=lambda ra: -ra[0].latency_s)[:3]],
        "longest_turn": {"program": turns[0][0], "turn": turns[0][1], "seconds": round(turns[0][2], 3)}
        if turns else None,
    }


def ratios(modes: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each mode against ``per-request``: latencies the base's over the mode's (above 1 is better); throughput the
    mode's over the base's (about 1: equal throughput, the latencies compare like with like)."""
    base = modes.get(BASE_MODE)
    if base is None:
        return {}

    def over(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
        return a[key] / b[key] if a.get(key) and b.get(key) else None

    return {mode: {"mean": over(base, row, "mean_s"), "p95": over(base, row, "p95_s"),
                   "throughput": over(row, base, "throughput"),
                   "kinds_mean": {k: over(base["kinds"].get(k, {}), v, "mean_s") for k, v in row["kinds"].items()}}
            for mode, row in modes.items() if mode != BASE_MODE}


def point_line(row: dict[str, Any]) -> str:
    return (f"{row['completed']}/{row['arrivals']} programs done, mean {fmt(row['mean_s'])}s p95 {fmt(row['p95_s'])}s "
            f"max {fmt(row['max_s'])}s, throughput {fmt(row['throughput'], '.4f')}/s, hit rate "
            f"{fmt(row['hit_rate'], '.1%')}; " + ", ".join(f"{k} {fmt(v['mean_s'])}s" for k, v in row["kinds"].items()))


def mixed_programs_table(mixed: dict[str, Any]) -> list[str]:
    """The benchmark's text table (results.txt)."""
    shape = mixed["shape"]
    cap = mixed.get("capacity")
    lines = [f"== mixed ({shape['name']}): one Poisson stream of programs, {mixed['programs']} arrivals per point and "
             "mode: " + ", ".join(f"{n} {k}" for k, n in mixed["mix"].items() if n) + " =="]
    if cap:
        lines.append(f"capacity {cap['programs_per_s']:.4f} programs/s: {cap['window_programs']} finished in "
                     f"{cap['window_s']:.1f}s with {cap['concurrency']} closed-loop programs busy (tools instant)")
        if cap.get("failed"):
            lines.append(f"  {cap['failed']} probe programs failed: {cap['errors'][0]}")
    kinds = [k for k in KINDS if mixed["mix"].get(k)]
    lines.append(f"{'load':>5} {'mode':<16} {'rate/s':>7} {'done':>7} {'mean':>7} {'p95':>7} {'max':>7} "
                 f"{'thru/s':>7} {'hit rate':>8} {'prefill/prog':>12} " + " ".join(f"{k[:10]:>10}" for k in kinds))
    for point in mixed["points"]:
        load = "-" if point["fraction"] is None else f"{point['fraction']:g}"
        for mode, r in point["modes"].items():
            done = f"{r['completed']}/{r['arrivals']}"
            lines.append(f"{load:>5} {mode:<16} {point['rate']:7.4f} {done:>7} {fmt(r['mean_s']):>7} "
                         f"{fmt(r['p95_s']):>7} {fmt(r['max_s']):>7} {fmt(r['throughput'], '.4f'):>7} "
                         f"{fmt(r['hit_rate'], '.1%'):>8} {fmt(r['prefilled_per_program'], '.0f'):>12} "
                         + " ".join(f"{fmt(r['kinds'].get(k, {}).get('mean_s')):>10}" for k in kinds))
        for mode, v in point["ratios"].items():
            lines.append(f"      {mode} vs {BASE_MODE}: mean {fmt(v['mean'])}x, p95 {fmt(v['p95'])}x, at "
                         f"{fmt(v['throughput'])}x its throughput; per kind mean "
                         + ", ".join(f"{k} {fmt(x)}x" for k, x in v["kinds_mean"].items()))
    lines.append("seconds; a program: its first request sent to its last answer read (tools included); per-kind "
                 "columns: mean; thru: programs finished over first arrival to last finish; max: the oldest wait")
    return lines
