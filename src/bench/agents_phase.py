"""The ``agents`` benchmark's phase: capacity probe, Poisson load points per mode, and its figures.

Capacity is measured, not assumed: a closed loop of ``probe_agents`` agents (each starting the next
agent as soon as its last ends) with instant tools, in the ``per-request`` mode, counts the turns
the daemon answers while every probe agent is busy; turns per second over the mean turns per agent
(of the shape's distribution) is programs per second. Tools cost the engine nothing, so this is the
engine's own rate at that concurrency. Each load point is ``programs`` Poisson arrivals at a
fraction of it (or at a rate given), the same seeded arrivals and the same agents in every mode.

Per point and mode: job completion time (mean, p95; an agent's first request to its last answer,
its tool time included), each turn's latency as the client saw it (mean, p95) and time to first
token from the daemon's ``headrace_time_to_first_token_seconds`` histogram (mean exact from its sum,
p95 interpolated within its buckets), the prefix cache's hit rate (``headrace_prefix_cache_hits`` /
``headrace_prefix_cache_queries``, before/after deltas), tokens prefilled per job (prompt tokens
from each response's ``usage`` less those the engine found cached, ``headrace_prompt_cached_tokens``:
the prefix cache's hits, and also a retained program's context still in the engine's cells and what a
KV tier restored, which the prefix cache's counter leaves out), completed agents, and the oldest waits (the
longest turns and jobs). Each mode starts with an empty prefix cache.

Beside the agents, optionally (``agents_chats``): a background stream of unrelated chats, and probe
chats whose time to first token is set against an idle engine's; each reported on its own and taken
out of the agents' figures (the agents' TTFT p95 then goes: the histogram's buckets cannot be split).

The ``responses`` mode (``agents.RESPONSES_MODE``) serves the same agents through ``POST /v1/responses``
in ``program-aware``'s settings; each point compares it with that mode (``protocol``): the same engine
settings, the protocol alone differing. Its prompt and cached tokens come from the Responses usage
(``input_tokens``, ``input_tokens_details.cached_tokens``); the prefix cache's figures from the same counters.

Memory: retention saves prefill only when the live agents' contexts exceed the prefix cache. Each point
sets the cache in force (``agents_cache_tokens``/``pin_tokens``: a memory-pressure point, the whole
phase under that budget, put back after) beside each mode's live working set measured from the run
(``live_working_set``), and says whether the cache was below it.
"""

from __future__ import annotations

import statistics
import time
import uuid
from typing import Any, Callable

import anyio

from headrace.bench.agents import (BASE_MODE, RESPONSES_MODE, RESPONSES_SETTINGS, VLLM_MODE, AgentClient, AgentRecord,
                                   AgentsOptions, Api, Program, build_prompts, draw_programs, mean_turns)
from headrace.bench.agents_chats import CACHED, ChatStream, exclude, idle_ttft, run_stream
from headrace.bench.agents_vllm import check_vllm, vllm_daemon, vllm_line
from headrace.bench.client import BenchError, Daemon
from headrace.bench.corpus import Corpus
from headrace.bench.load import percentile, poisson
from headrace.bench.phases import (E2E, TTFT, daemon_tokenizer, deltas, fmt, histogram_quantile, measure_point,
                                   use_mode)


async def agents_phase(systems: Any, corpus: Corpus, opts: AgentsOptions, log: Callable[[str], None]) -> dict[str, Any]:
    """The whole benchmark against ``systems``' daemon (a started ``harness.Systems``)."""
    try:
        opts.check()
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    check_vllm(opts)  # a missing .venv-vllm fails now, not after the probe and the other modes' points
    if "llm" not in systems.models:
        raise BenchError("the agents benchmark needs an LLM engine")
    daemon, llm, shape = systems.daemon, systems.models["llm"], opts.shape
    system, snippets, sizes = await build_prompts(corpus, shape, *daemon_tokenizer(systems), seed=opts.seed)
    programs = draw_programs(opts.programs, shape, corpus, snippets, opts.seed)
    run_tag = uuid.uuid4().hex[:8]  # program ids never repeat across runs: the daemon keeps attained service
    out: dict[str, Any] = {"shape": {**vars(shape), **sizes, "mean_turns": mean_turns(shape)},
                           "modes": list(opts.modes), "programs": opts.programs, "seed": opts.seed,
                           "drain_s": opts.drain_s, "points": [],
                           "beside": [{"name": c.name, "rate": c.rate, "prompt_tokens": c.prompt_tokens,
                                       "max_tokens": c.max_tokens} for c in side_streams(opts)]}
    log(f"  agents ({shape.name}): system prompt {sizes['system_tokens']} tokens with the tool schemas, "
        f"{opts.programs} agents per point, {sum(p.turns for p in programs)} turns, modes {', '.join(opts.modes)}")
    client = AgentClient(daemon.base_url, daemon.api_key, llm, shape, system)
    base_restore: dict[str, Any] = {}
    try:
        # The warm-up and the probe run in the base mode, with the point's cache: capacity under its memory.
        base_restore = await use_mode(systems, BASE_MODE, {}, opts.budget)
        out["prefix_cache"] = await cache_in_force(systems, opts)
        log("    " + cache_line(out["prefix_cache"]))
        if opts.fractions or set(opts.modes) - {VLLM_MODE}:  # a daemon that serves no measured agent needs none
            await client.warm_up(programs[0].task)
        capacity = None
        if opts.fractions:
            probe = draw_programs(shape.probe_programs, shape, corpus, snippets, opts.seed + 1)
            out["capacity"] = await probe_capacity(client, probe, opts.probe_agents or shape.probe_agents,
                                                   mean_turns(shape), f"bench-{run_tag}-probe")
            capacity = out["capacity"]["programs_per_s"]
            log(f"    capacity: {capacity:.4f} agents/s ({out['capacity']['turns_per_s']:.3f} turns/s, "
                f"{out['capacity']['agents']} agents at once in a closed loop, tools instant)")
        points = [{"fraction": f, "rate": round(f * capacity, 5)} for f in opts.fractions] + \
                 [{"fraction": None, "rate": r} for r in opts.rates]

        async def measure(p: int, rate: float, mode: str) -> dict[str, Any]:
            key = f"bench-{run_tag}-p{p}-{mode}"
            if mode == RESPONSES_MODE:  # the settings of the chat mode it is compared with, set here
                restore = await use_mode(systems, RESPONSES_SETTINGS, {})
                try:
                    return await run_point(daemon, llm, client, programs, rate, opts, key, snippets, api="responses")
                finally:
                    await use_mode(systems, None, restore)
            if mode != VLLM_MODE:
                return await run_point(daemon, llm, client, programs, rate, opts, key, snippets)
            async with vllm_daemon(opts, system, programs[0].task, log) as v:  # one per point: agents_vllm says why
                row = await run_point(v.daemon, v.llm, v.client, programs, rate, opts, key, snippets, "usage")
            return {**row, "vllm": v.info}

        for p, point in enumerate(points):
            out["points"].append(await measure_point(
                systems, opts.modes, p, point, lambda mode: measure(p, point["rate"], mode),
                lambda mode, row: log(f"    agents {point['rate']:g}/s, {mode}: " + point_line(row)), ratios,
                elsewhere={VLLM_MODE, RESPONSES_MODE}))  # their measure() sets their daemon's settings
            if RESPONSES_MODE in opts.modes and RESPONSES_SETTINGS in opts.modes:
                out["points"][-1]["protocol"] = protocol(out["points"][-1]["modes"])
                log("    " + protocol_line(out["points"][-1]["protocol"]))
            if set(opts.modes) - {VLLM_MODE}:  # the headrace daemon's cache against its own modes' live sets
                out["points"][-1]["memory"] = memory(out["prefix_cache"], out["points"][-1]["modes"])
                log("    " + memory_line(out["points"][-1]["memory"]))
    finally:
        await client.aclose()
        await use_mode(systems, None, base_restore)  # the daemon's own settings again (a shared daemon serves on)
    return out


async def cache_in_force(systems: Any, opts: AgentsOptions) -> dict[str, Any]:
    """The LLM's prefix cache budget the agents run with (the daemon's settings, read back) and who set it."""
    settings = await systems.daemon.engine_settings(systems.models["llm"])
    return {"tokens": settings.get("prefix_cache_tokens"), "pin_tokens": settings.get("prefix_cache_pin_tokens"),
            "set_by": None if opts.cache_tokens is None else "--agents-cache-tokens"}


def live_working_set(records: list[AgentRecord]) -> dict[str, float | None]:
    """The agents' live working set over a point, measured: at each moment the sum of the contexts of the agents
    between their first request and their last answer (an agent's context: its latest turn's prompt tokens from
    that turn's send, with its output once answered; each counted whole, as a cache entry holds it), and the live
    agents; time-weighted mean and peak from the first request to the last answer."""
    events: list[tuple[float, int, int]] = []  # (time, tokens added, agents added)
    for r in records:
        if r.started_s is None or not r.turns:
            continue
        held = 0
        events.append((r.started_s, 0, 1))
        for t in r.turns:
            for at, size in ((t.answered_s - t.latency_s, t.prompt_tokens),
                             (t.answered_s, t.prompt_tokens + t.completion_tokens)):
                events.append((at, size - held, 0))
                held = size
        end = r.started_s + r.job_s if r.job_s is not None else r.turns[-1].answered_s
        events.append((max(end, r.turns[-1].answered_s), -held, -1))
    if not events:
        return {"live_tokens_mean": None, "live_tokens_peak": None, "live_agents_mean": None, "live_agents_peak": None}
    events.sort()  # at one instant the drops come first: the peak is one the set really held
    tokens = agents = peak_tokens = peak_agents = 0
    area_tokens = area_agents = 0.0
    for (at, d_tokens, d_agents), (nxt, _, _) in zip(events, events[1:] + events[-1:]):
        tokens, agents = tokens + d_tokens, agents + d_agents
        peak_tokens, peak_agents = max(peak_tokens, tokens), max(peak_agents, agents)
        area_tokens += tokens * (nxt - at)
        area_agents += agents * (nxt - at)
    span = events[-1][0] - events[0][0]
    return {"live_tokens_mean": area_tokens / span if span > 0 else None, "live_tokens_peak": peak_tokens,
            "live_agents_mean": area_agents / span if span > 0 else None, "live_agents_peak": peak_agents}


def memory(cache: dict[str, Any], modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A point's memory: the prefix cache's budget beside each mode's measured live working set; memory-pressured
    when the cache holds less than the live set's mean in every mode (retention then has something to save)."""
    live = {mode: {"mean": row.get("live_tokens_mean"), "peak": row.get("live_tokens_peak")}
            for mode, row in modes.items() if mode != VLLM_MODE}  # vLLM's cache is not this budget (agents_vllm)
    means = [v["mean"] for v in live.values()]
    pressured = bool(cache.get("tokens") and means) and all(m is not None and cache["tokens"] < m for m in means)
    return {"cache_tokens": cache.get("tokens"), "pin_tokens": cache.get("pin_tokens"),
            "set_by": cache.get("set_by"), "live_tokens": live, "memory_pressured": pressured}


def cache_line(cache: dict[str, Any]) -> str:
    by = f" (set by {cache['set_by']})" if cache.get("set_by") else " (the daemon's own)"
    return f"prefix cache {fmt(cache.get('tokens'), 'd')} tokens, pins {fmt(cache.get('pin_tokens'), 'd')}{by}"


def memory_line(mem: dict[str, Any]) -> str:
    live = ", ".join(f"{mode} mean {fmt(v['mean'], '.0f')} peak {fmt(v['peak'], 'd')}"
                     for mode, v in mem["live_tokens"].items())
    verdict = "MEMORY-PRESSURED: cache < live set" if mem["memory_pressured"] else "not memory-pressured"
    return (f"{verdict}: prefix cache {fmt(mem['cache_tokens'], 'd')} tokens against the live agents' contexts "
            f"summed ({live} tokens)")


async def probe_capacity(client: AgentClient, probe: list[Program], agents: int, turns_per_agent: float,
                         key: str) -> dict[str, Any]:
    """Agents per second at saturation: turns answered while all ``agents`` closed-loop agents were busy, per
    second, over the mean turns per agent."""
    queue = iter(probe)
    done = {"turns": 0}
    window: dict[str, float] = {}
    t0 = time.perf_counter()

    def turn() -> None:
        done["turns"] += 1

    errors: list[str] = []

    async def agent() -> None:
        for program in queue:
            try:
                await client.run(program, f"{key}-{program.index}", AgentRecord(program.index, program.turns),
                                 tools_wait=False, on_turn=turn)
            except Exception as exc:  # counted; a probe that answers nothing stops the benchmark below
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
        if not window:  # the first agent out of work ends the window in which all were busy
            window.update(seconds=time.perf_counter() - t0, turns=done["turns"])

    async with anyio.create_task_group() as tg:
        for _ in range(min(agents, len(probe))):
            tg.start_soon(agent)
    if not done["turns"]:
        raise BenchError(f"the capacity probe's agents got no answer: {errors[:1]}")
    turns_per_s = window["turns"] / window["seconds"] if window["turns"] else done["turns"] / (time.perf_counter() - t0)
    return {"agents": min(agents, len(probe)), "programs": len(probe), "failed": len(errors),
            "errors": errors[:3], "window_s": window["seconds"],
            "window_turns": window["turns"], "turns_per_s": turns_per_s,
            "programs_per_s": turns_per_s / turns_per_agent, "elapsed_s": time.perf_counter() - t0}


def side_streams(opts: AgentsOptions) -> list[ChatStream]:
    """The chat streams beside the agents the options ask for (``agents_chats``)."""
    shape, out = opts.shape, []
    if opts.background > 0:
        out.append(ChatStream("background", opts.background, opts.background_tokens or shape.background_tokens,
                              shape.chat_output, opts.seed))
    if opts.chats > 0:
        out.append(ChatStream("chats", opts.chats, shape.chat_tokens, shape.chat_output, opts.seed))
    return out


async def run_point(daemon: Daemon, llm: str, client: AgentClient, programs: list[Program], rate: float,
                    opts: AgentsOptions, key: str, snippets: list[str] | None = None,
                    hits_from: str = "metrics", api: Api = "chat") -> dict[str, Any]:
    """One point's agents in one mode against ``daemon`` serving ``llm``; ``hits_from`` as ``summarize`` takes it;
    ``api``: the agents' protocol (``AgentClient.run``)."""
    records = [AgentRecord(p.index, p.turns) for p in programs]

    async def agent(i: int) -> None:
        await client.run(programs[i], f"{key}-{i}", records[i], api=api)

    streams, span = side_streams(opts), opts.shape.result_tokens
    idle = None
    for stream in streams:  # the probe chats' idle figure: the same kind of chat, nothing beside it
        if stream.name == "chats":
            idle = await idle_ttft(client.client, llm, stream, snippets or ["-"], span, key, opts.idle_chats)
    before = await daemon.metrics()
    side: dict[str, dict[str, Any]] = {}
    stop = anyio.Event()

    async def send(stream: ChatStream) -> None:
        side[stream.name] = await run_stream(client.client, llm, stream, snippets or ["-"], span, key, stop,
                                             opts.drain_s)

    async with anyio.create_task_group() as tg:
        for stream in streams:
            tg.start_soon(send, stream)
        try:
            result = await poisson({"agents": agent}, rate, 0.0, 0.0, opts.seed, opts.drain_s, count=len(programs))
        finally:
            stop.set()  # the streams run while the agents do
    delta = exclude(deltas(before, await daemon.metrics(), llm), list(side.values()))
    row = summarize(records, result, delta, split=bool(side), hits_from=hits_from)
    if "background" in side:
        row["background"] = side["background"]
    if "chats" in side:
        chats = side["chats"]
        row["chats"] = {**chats, "idle": idle,
                        "ttft_vs_idle": _over(chats["ttft_mean_s"], idle and idle["ttft_mean_s"]),
                        "ttft_p95_vs_idle": _over(chats["ttft_p95_s"], idle and idle["ttft_mean_s"])}
    return row


def _over(x: float | None, y: float | None) -> float | None:
    return x / y if x is not None and y else None


def summarize(records: list[AgentRecord], result: Any, delta: dict[tuple[str, str], float],
              split: bool = False, hits_from: str = "metrics") -> dict[str, Any]:
    """A point's figures; ``split``: ``delta`` had chats beside the agents taken out (``exclude``), so the TTFT
    histogram's p95, whose buckets hold theirs too, is not the agents'. ``hits_from``: the prefix cache's
    queries and hits from the daemon's ``headrace_prefix_cache_*`` counters ("metrics"), or from the agents' own
    turns' ``usage`` ("usage": an engine without those counters, vLLM's); with "usage" and no turn reporting a
    cached token, no hit rate and no tokens prefilled (an engine that does not say reports 0), and why."""
    jobs = sorted(r.job_s for r in records if r.job_s is not None)
    turns = [(r.program, t) for r in records for t in r.turns]
    latencies = sorted(t.latency_s for _, t in turns)
    prompt = sum(t.prompt_tokens for _, t in turns)
    queries = delta.get(("headrace_prefix_cache_queries_total", ""), 0.0)
    hits = delta.get(("headrace_prefix_cache_hits_total", ""), 0.0)
    # Not prefilled: the prefix cache's hits, a context retained in the cells, a KV tier's restore (a daemon from
    # before that counter: the prefix cache's hits alone).
    cached = delta.get(CACHED, hits)
    note = None
    if hits_from == "usage":
        queries, hits = float(prompt), float(sum(t.cached_tokens for _, t in turns))
        cached = hits
        if not hits:
            note = ("no turn's usage.prompt_tokens_details.cached_tokens was above 0 (an engine that does not say "
                    "reports 0)")
    known = note is None
    ttft_n = delta.get((f"{TTFT}_count", ""), 0.0)
    requests = delta.get((f"{E2E}_count", ""), 0.0)
    done = [r for r in records if r.job_s is not None]
    longest_turns = sorted(turns, key=lambda pt: -pt[1].latency_s)[:3]
    return {
        "rate": result.rate, "arrivals": len(records), "completed": len(done),
        "errors": sorted({s.error for s in result.samples if s.error})[:3],
        "turns_planned": sum(r.planned_turns for r in records),
        "turns_sent": sum(r.sent for r in records), "turns_answered": len(turns),
        "turns_of_completed": sum(r.planned_turns for r in done), "daemon_requests": int(requests),
        "job_mean_s": statistics.fmean(jobs) if jobs else None, "job_p50_s": percentile(jobs, 50),
        "job_p95_s": percentile(jobs, 95), "job_max_s": jobs[-1] if jobs else None,
        "tool_mean_s": statistics.fmean(r.tool_s for r in done) if done else None,
        "turn_mean_s": statistics.fmean(latencies) if latencies else None,
        "turn_p95_s": percentile(latencies, 95),
        "ttft_mean_s": delta.get((f"{TTFT}_sum", ""), 0.0) / ttft_n if ttft_n else None,
        # Each turn's TTFT is within its latency, so the turns' p95 bounds the histogram's coarse interpolation.
        "ttft_p95_s": None if split else _at_most(histogram_quantile(delta, TTFT, 0.95), percentile(latencies, 95)),
        "prefix_queries": int(queries), "prefix_hits": int(hits),
        "hit_rate": hits / queries if queries and known else None, "hits_from": hits_from, "cache_note": note,
        "prompt_tokens": prompt, "daemon_prompt_tokens": int(delta.get(("headrace_prompt_tokens_total", ""), 0.0)),
        "usage_cached_tokens": sum(t.cached_tokens for _, t in turns),  # the responses' own count of cached_tokens
        "cached_tokens": int(cached),
        "tokens_prefilled": int(prompt - cached) if known else None,
        "prefilled_per_job": (prompt - cached) / len(records) if records and known else None,
        "max_context_tokens": max((t.prompt_tokens for _, t in turns), default=0),
        **live_working_set(records),
        "makespan_s": result.makespan,
        # The oldest waits: the longest any turn waited for its answer, and the slowest agents.
        "longest_turns": [{"program": p, "turn": t.index, "seconds": round(t.latency_s, 3)} for p, t in longest_turns],
        "longest_jobs": [{"program": r.program, "turns": r.planned_turns, "seconds": round(r.job_s, 3),
                          "tool_s": round(r.tool_s, 3)}
                         for r in sorted(done, key=lambda r: -(r.job_s or 0))[:3]],
    }


def _at_most(x: float | None, bound: float | None) -> float | None:
    return x if x is None or bound is None else min(x, bound)


def against(base: dict[str, Any], row: dict[str, Any]) -> dict[str, float | None]:
    """``row``'s figures against ``base``'s (the base's over the row's: above 1 is better)."""

    def over(key: str) -> float | None:
        return base[key] / row[key] if base.get(key) and row.get(key) else None

    return {"job_mean": over("job_mean_s"), "job_p95": over("job_p95_s"), "ttft_mean": over("ttft_mean_s"),
            "prefilled_per_job": over("prefilled_per_job")}


def ratios(modes: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each mode against ``per-request``."""
    base = modes.get(BASE_MODE)
    if base is None:
        return {}
    return {mode: against(base, row) for mode, row in modes.items() if mode != BASE_MODE}


def protocol(modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The Responses API mode against chat completions with ``prompt_cache_key`` in the same engine settings."""
    return {"mode": RESPONSES_MODE, "against": RESPONSES_SETTINGS,
            **against(modes[RESPONSES_SETTINGS], modes[RESPONSES_MODE])}


def protocol_line(v: dict[str, Any]) -> str:
    return (f"{v['mode']} vs {v['against']} (chat completions, prompt_cache_key): job mean {fmt(v['job_mean'])}x, "
            f"p95 {fmt(v['job_p95'])}x, TTFT {fmt(v['ttft_mean'])}x, tokens prefilled "
            f"{fmt(v['prefilled_per_job'])}x fewer")


def point_line(row: dict[str, Any]) -> str:
    line = (f"{row['completed']}/{row['arrivals']} agents done, job mean {fmt(row['job_mean_s'])}s p95 "
            f"{fmt(row['job_p95_s'])}s, TTFT mean {fmt(row['ttft_mean_s'])}s, "
            f"hit rate {_cache(row, 'hit_rate', '.1%')}, {_cache(row, 'prefilled_per_job', '.0f')} tokens prefilled "
            "per job")
    return "; ".join([line, *side_lines(row), *([vllm_line(row)] if "vllm" in row else [])])


def _cache(row: dict[str, Any], key: str, spec: str) -> str:
    """A prefix-cache figure; "n/a" where the engine did not report one (``cache_note`` says why)."""
    return "n/a" if row.get("cache_note") else fmt(row[key], spec)


def side_lines(row: dict[str, Any]) -> list[str]:
    """The chats beside a point's agents, a line each."""
    lines = []
    bg = row.get("background")
    if bg:
        lines.append(f"background {bg['completed']}/{bg['sent']} chats at {bg['rate']:g}/s, latency mean "
                     f"{fmt(bg['latency_mean_s'])}s p95 {fmt(bg['latency_p95_s'])}s, "
                     f"TTFT mean {fmt(bg['ttft_mean_s'])}s")
    chats = row.get("chats")
    if chats:
        idle = chats.get("idle") or {}
        lines.append(f"one-call chats {chats['completed']}/{chats['sent']} at {chats['rate']:g}/s, TTFT mean "
                     f"{fmt(chats['ttft_mean_s'])}s p95 {fmt(chats['ttft_p95_s'])}s, "
                     f"idle {fmt(idle.get('ttft_mean_s'))}s: "
                     f"{fmt(chats['ttft_vs_idle'])}x idle (p95 {fmt(chats['ttft_p95_vs_idle'])}x)")
    return lines


def agents_table(agents: dict[str, Any]) -> list[str]:
    """The benchmark's text table (results.txt)."""
    shape = agents["shape"]
    cap = agents.get("capacity")
    lines = [f"== agents ({shape['name']}): client-side tool-calling agents, {agents['programs']} Poisson arrivals "
             f"per point and mode, turns {shape['turns'][0]}-{shape['turns'][1]} (mean {shape['mean_turns']:.2f}), "
             f"tools {shape['tool_s'][0]:g}-{shape['tool_s'][1]:g}s, system prompt {shape['system_tokens']} tokens =="]
    for c in agents.get("beside", []):
        label = "one-call probe" if c["name"] == "chats" else c["name"]
        lines.append(f"beside the agents: {label} chats at {c['rate']:g}/s, prompts of about {c['prompt_tokens']} "
                     f"tokens, {c['max_tokens']} out" + (", TTFT against an idle engine's" if c["name"] == "chats" else ""))
    if cap:
        lines.append(f"capacity {cap['programs_per_s']:.4f} agents/s: {cap['turns_per_s']:.3f} turns/s with "
                     f"{cap['agents']} closed-loop agents busy (tools instant), over {shape['mean_turns']:.2f} turns "
                     "per agent")
        if cap.get("failed"):
            lines.append(f"  {cap['failed']} probe agents failed: {cap['errors'][0]}")
    if agents.get("prefix_cache"):
        lines.append(cache_line(agents["prefix_cache"]))
    lines.append(f"{'load':>5} {'mode':<16} {'rate/s':>7} {'arrived':>7} {'done':>4} {'job mean':>8} {'job p95':>8} "
                 f"{'TTFT mean':>9} {'TTFT p95':>8} {'turn p95':>8} {'hit rate':>8} {'prefill/job':>11} "
                 f"{'oldest turn':>11}")
    for point in agents["points"]:
        load = "-" if point["fraction"] is None else f"{point['fraction']:g}"
        for mode, r in point["modes"].items():
            oldest = r["longest_turns"][0]["seconds"] if r["longest_turns"] else None
            lines.append(f"{load:>5} {mode:<16} {point['rate']:7.4f} {r['arrivals']:7d} {r['completed']:4d} "
                         f"{fmt(r['job_mean_s']):>8} {fmt(r['job_p95_s']):>8} {fmt(r['ttft_mean_s']):>9} "
                         f"{fmt(r['ttft_p95_s']):>8} {fmt(r['turn_p95_s']):>8} {_cache(r, 'hit_rate', '.1%'):>8} "
                         f"{_cache(r, 'prefilled_per_job', '.0f'):>11} {fmt(oldest):>11}")
            lines += [f"      {mode}: {line}" for line in side_lines(r)]
            if "vllm" in r:
                lines.append(f"      {vllm_line(r)}")
        if point.get("memory"):
            lines.append("      " + memory_line(point["memory"]))
        for mode, v in point["ratios"].items():
            lines.append(f"      {mode} vs {BASE_MODE}: job mean {fmt(v['job_mean'])}x, p95 {fmt(v['job_p95'])}x, "
                         f"TTFT {fmt(v['ttft_mean'])}x, tokens prefilled {fmt(v['prefilled_per_job'])}x fewer")
        if point.get("protocol"):
            lines.append("      " + protocol_line(point["protocol"]))
    lines.append("seconds; job: first request to last answer, tools included; TTFT from the daemon's histogram "
                 "(p95 within its buckets, capped at the turns' p95; none with chats beside the agents); oldest "
                 "turn: the longest one turn waited; background and one-call chats: apart from the agents' figures")
    return lines
