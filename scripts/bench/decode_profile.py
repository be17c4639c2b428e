#!/usr/bin/env python3
"""Where a decoded token's time goes in headrace (issue 51, part 1): py-spy on every thread of the daemon while
``peers.py``'s decode workload runs at 1, 4 and 16 streams.

    python scripts/bench/decode_profile.py [--config configs/default.toml] [--streams 1 4 16] [--seconds 20]
                                           [--out bench-results/decode-profile.json] [--stream-interval N] [--tiny]

The daemon is ``headrace serve`` on the config's LLM alone (``peers.py``'s ``llm_only``), a fresh data dir. Per
stream count, a client keeps that many streamed ``/v1/completions`` requests in flight (``peers.py``'s chat
prompts, greedy, 128 tokens, a new connection per request, as ``peers.py`` sends them) while ``py-spy record
--threads --idle --nonblocking`` samples the daemon for ``--seconds``. Each sample is put in one bucket by its
thread and its frames:

- the engine's worker thread (``headrace-<llm>``): ``llama_decode`` (the C kernels: the sample's innermost
  Python frame is the line that calls it), ``sampling`` (``sample_rows_numpy``), ``emitting`` (the row's
  token to text: detokenizing, stop strings, the outbox), ``waiting`` (blocked for its next command: no work,
  or the front not yet sent it), and ``python`` (the rest: batch planning, bookkeeping, the step loop);
- the event loop (``MainThread``): ``in the C loop`` (uvloop: waiting in epoll, or its own C work; the
  selector with asyncio's loop) or ``python`` (HTTP, SSE, the scheduler, the front: every Python callback);
- any other thread: ``other`` (idle or not).

Beside the samples, each thread's CPU seconds over the window (``/proc/<pid>/task/*/stat``), and the
process's: on 2 cores the decode's OpenMP threads and the event loop contend, which py-spy, a wall-clock
sampler, shows only as time in whatever frame the thread was descheduled in. py-spy's ``--nonblocking``
reads the process without pausing it, so it costs the daemon little; its samples are then not exact.

--tiny: a few seconds a level, 1 and 2 streams, 8 tokens: checks the script works, measures nothing.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from pathlib import Path
from time import perf_counter
from typing import Any

import anyio
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import write_results  # noqa: E402 (beside this script)
from peers import ROOT, Client, headrace_spec, llm_only, running, workload  # noqa: E402

LLM_DECODE_CALL = "lc.llama_decode(self._ctx, batch)"
ENGINE_FILE = ROOT / "src" / "plugins" / "engines" / "llama_cpp" / "engine.py"
WAITING = ("wait (threading.py", "get (queue.py")  # the worker blocked for its next command
C_LOOP = ("Runner.run (", "BaseEventLoop.run_forever (", "select (selectors.py", "EpollSelector.select (")
ENGINE_EMIT = "emit (src/plugins/engines/llm/core.py"
PY_SPY = Path(sys.executable).with_name("py-spy")


def decode_line() -> int:
    """The line of the engine's ``llama_decode`` call: a sample whose innermost frame is there is in the kernels."""
    for n, line in enumerate(ENGINE_FILE.read_text().splitlines(), 1):
        if LLM_DECODE_CALL in line:
            return n
    raise SystemExit(f"{ENGINE_FILE} no longer has `{LLM_DECODE_CALL}`: update decode_profile.py")


def bucket(thread: str, frames: list[str], engine_thread: str, kernel: str) -> str:
    leaf = frames[-1] if frames else ""
    if thread == engine_thread:
        if "_decode (" in leaf and kernel in leaf:
            return "engine: llama_decode"
        if any("sample_rows_numpy (" in f for f in frames):
            return "engine: sampling"
        if any(f.endswith(ENGINE_EMIT) or ".emit (" in f for f in frames):
            return "engine: emitting"
        if "_take_commands (" in leaf or any(w in leaf for w in WAITING):
            return "engine: waiting"
        return "engine: python"
    if thread == "MainThread":
        # uvloop runs the loop in C: a sample there is the loop waiting in epoll, or its own C work.
        return "event loop: in the C loop" if leaf.startswith(C_LOOP) else "event loop: python"
    return "other threads"


def classify(raw: str, engine_thread: str) -> dict[str, int]:
    """Samples per bucket from py-spy's raw output (``thread (tid): name;frame;frame count`` a line)."""
    kernel = f"llama_cpp/engine.py:{decode_line()})"
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        head, *frames = stack.split(";")
        thread = head.split(": ", 1)[1] if ": " in head else head
        counts[bucket(thread, frames, engine_thread, kernel)] += int(n)
    return dict(counts)


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) so far of each thread of ``pid``, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def thread_names(raw: str) -> dict[int, str]:
    """Python threads' names by thread id, from py-spy's raw lines; a thread py-spy never saw runs no Python."""
    names = {}
    for line in raw.splitlines():
        head = line.split(";", 1)[0]
        if head.startswith("thread (") and "): " in head:
            tid, name = head[len("thread ("):].split("): ", 1)
            names[int(tid, 0)] = name
    return names


async def keep_streams(client: Client, prompts: list[str], streams: int, max_tokens: int, stop: anyio.Event,
                       work) -> int:
    """``streams`` requests in flight until ``stop``; the tokens received."""
    received = 0

    async def lane(k: int) -> None:
        nonlocal received
        i = k
        while not stop.is_set():
            got = await client.stream(prompts[i % len(prompts)], max_tokens)
            received += work.count(got.text)
            i += streams

    async with anyio.create_task_group() as tg:
        for k in range(streams):
            tg.start_soon(lane, k)
    return received


async def level(base: str, pid: int, streams: int, seconds: float, max_tokens: int, work, tmp: Path,
                engine_thread: str, keep: Path | None) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as http:
        client = Client(http, {})
        await client.stream(work.chat[0], min(max_tokens, 16))  # warm
        stop = anyio.Event()
        result: dict[str, Any] = {}

        async def drive() -> None:
            start = perf_counter()
            result["tokens"] = await keep_streams(client, work.chat, streams, max_tokens, stop, work)
            result["wall"] = perf_counter() - start

        raw = tmp / f"spy-{streams}.txt"
        async with anyio.create_task_group() as tg:
            tg.start_soon(drive)
            await anyio.sleep(min(3.0, seconds / 4))  # every lane decoding before sampling starts
            cpu0, t0 = thread_cpu(pid), perf_counter()
            await anyio.run_process([str(PY_SPY), "record", "--pid", str(pid), "--rate", "200", "--format", "raw",
                                     "--threads", "--idle", "--nonblocking", "--duration", str(int(seconds)),
                                     "-o", str(raw)], check=True)
            cpu1, wall = thread_cpu(pid), perf_counter() - t0
            stop.set()  # each lane ends with its request in flight
    spied = raw.read_text()
    if keep is not None:  # py-spy's own output, for a flame graph or a look
        keep.mkdir(parents=True, exist_ok=True)
        (keep / raw.name).write_text(spied)
    samples = classify(spied, engine_thread)
    engine = {k: v for k, v in samples.items() if k.startswith("engine: ")}
    loop = {k: v for k, v in samples.items() if k.startswith("event loop: ")}
    names = thread_names(spied)
    cpu: collections.Counter[str] = collections.Counter()
    for tid, seconds in cpu1.items():  # the OpenMP workers of llama.cpp run no Python: "native"
        cpu[names.get(tid, "native")] += round(seconds - cpu0.get(tid, 0), 2)
    return {"streams": streams, "wall_s": round(wall, 2),
            # over the whole drive (warm-in, the window, the requests in flight at its end)
            "decode_tok_s": round(result["tokens"] / result["wall"], 1), "samples": samples,
            "engine_share": {k: round(v / max(1, sum(engine.values())), 4) for k, v in sorted(engine.items())},
            "event_loop_share": {k: round(v / max(1, sum(loop.values())), 4) for k, v in sorted(loop.items())},
            "cpu_s": dict(sorted(cpu.items(), key=lambda kv: -kv[1])), "cpu_s_total": round(sum(cpu.values()), 2)}


def report(res: dict[str, Any]) -> None:
    print(f"\n{'streams':>7} {'tok/s':>6} {'llama_decode':>12} {'sampling':>8} {'emitting':>8} {'python':>7} {'waiting':>7}"
          f" {'loop py':>9} {'CPU s (of wall)':>16}  busiest threads")
    for lv in res["levels"]:
        e, lp = lv["engine_share"], lv["event_loop_share"]
        top = ", ".join(f"{k} {v:.1f}" for k, v in list(lv["cpu_s"].items())[:4])
        print(f"{lv['streams']:>7} {lv['decode_tok_s']:>6.0f} {e.get('engine: llama_decode', 0):>12.1%} {e.get('engine: sampling', 0):>8.1%} "
              f"{e.get('engine: emitting', 0):>8.1%} {e.get('engine: python', 0):>7.1%} "
              f"{e.get('engine: waiting', 0):>7.1%} {lp.get('event loop: python', 0):>9.1%} "
              f"{lv['cpu_s_total']:>7.1f} ({lv['wall_s']:.0f} s)  {top}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "default.toml")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "decode-profile.json")
    ap.add_argument("--keep-raw", type=Path, help="keep py-spy's raw samples (spy-<streams>.txt) in this folder")
    ap.add_argument("--stream-interval", type=int, default=None,
                    help="the LLM's stream_interval option (tokens a delta; the config's own if not given)")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    if args.tiny:
        args.streams, args.seconds, args.max_tokens = [1, 2], 2, 8
    if not PY_SPY.exists():
        raise SystemExit(f"py-spy is not installed beside {sys.executable} (pip install py-spy)")
    # peers.py's workload: its chat prompts (the long and prefill ones are not used here).
    work = workload(argparse.Namespace(ttft_reps=0, long_tokens=64, prefill_streams=1, rounds=0, prefill_tokens=32))
    t_start = perf_counter()
    levels = []
    with tempfile.TemporaryDirectory(prefix="headrace-decode-profile-") as tmp_s:
        tmp = Path(tmp_s)
        spec = llm_only(headrace_spec(sys.executable, args.config), tmp)
        llm = spec_llm(args.config)
        if args.stream_interval is not None:
            with_stream_interval(Path(spec.argv[spec.argv.index("--config") + 1]), args.stream_interval)
        with running(spec, tmp, 900) as (base, pids, _):
            for streams in args.streams:
                lv = anyio.run(level, base, pids[0], streams, args.seconds, args.max_tokens, work, tmp,
                               f"headrace-{llm}", args.keep_raw)
                levels.append(lv)
                print(f"{streams} streams: {lv['decode_tok_s']} tok/s; engine {lv['engine_share']}; "
                      f"event loop {lv['event_loop_share']}; CPU {lv['cpu_s_total']} s over {lv['wall_s']} s",
                      flush=True)
    res = {"tiny": args.tiny, "stream_interval": args.stream_interval, "config": str(args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT)
                                            else args.config),
           "seconds": args.seconds, "max_tokens": args.max_tokens, "levels": levels}
    write_results(res, args.out, t_start)
    report(res)
    print(f"\nwrote {args.out}")


def with_stream_interval(config: Path, interval: int) -> None:
    """``config`` (``llm_only``'s: the LLM's entry last, its options table last in it) with the LLM's
    ``stream_interval`` set."""
    import tomllib

    text = config.read_text()
    if "stream_interval" in text:
        raise SystemExit(f"{config} sets stream_interval already: leave --stream-interval out")
    config.write_text(text.rstrip("\n") + f"\nstream_interval = {interval}\n")
    entry = tomllib.loads(config.read_text())["engines"][-1]
    if entry.get("options", {}).get("stream_interval") != interval:
        raise SystemExit(f"{config}: the LLM's options are not the last table; set stream_interval in the config")


def spec_llm(config: Path) -> str:
    import tomllib

    engines = tomllib.loads(config.read_text())["engines"]
    return next(e["name"] for e in engines if e["plugin"] in ("llama-cpp", "torch"))


if __name__ == "__main__":
    main()
