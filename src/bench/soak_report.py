"""The soak's measurements of the daemon process (RSS, descriptors, threads from /proc), its pass/fail criteria,
and its result files.

The criteria are issue 41's for the hour: no lost run, no 5xx, RSS growth under 5% from the end of the warm-up
(600 s of an hour; a sixth of a shorter window) to the end, open descriptors flat, and, after the drain, nothing
left running or waiting in the daemon. Descriptors are compared idle to idle (before the first arrival, and after
the drain with the traffic's connections closed), since under load they rise and fall with the connections.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from headrace.bench.client import BenchError

RSS_LIMIT = 0.05  # growth from the warm-up's end to the end of the soak
FD_SLACK = 4  # descriptors the idle end may hold above the idle start (a socket still closing, a lazily opened file)
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0", "[::1]"}


class ProcWatch:
    """One process's resident memory, open descriptors and threads, read from /proc."""

    def __init__(self, pid: int | None) -> None:
        if pid is None:
            raise BenchError("the soak needs the daemon's process id (--soak-pid)")
        self.pid = pid
        try:
            os.listdir(f"/proc/{pid}/fd")
        except FileNotFoundError:
            raise BenchError(f"no process {pid} on this machine (--soak-pid)") from None
        except PermissionError:
            raise BenchError(f"cannot read /proc/{pid}/fd: run the soak as the daemon's user (or root)") from None

    def read(self) -> dict[str, Any]:
        """RSS in MiB, descriptors and threads; None each once the process is gone."""
        try:
            status = dict(line.split(":", 1) for line in Path(f"/proc/{self.pid}/status").read_text().splitlines()
                          if ":" in line)
            fds = len(os.listdir(f"/proc/{self.pid}/fd"))
        except (FileNotFoundError, ProcessLookupError):
            return {"rss_mib": None, "fds": None, "threads": None}
        return {"rss_mib": round(int(status["VmRSS"].split()[0]) / 1024, 1), "fds": fds,
                "threads": int(status["Threads"])}


def daemon_pid(base_url: str) -> int:
    """The process listening on ``base_url``'s port on this machine (a daemon reached with --url says no pid of its
    own): the socket's inode from /proc/net/tcp*, then the process holding it."""
    parts = urlsplit(base_url)
    if parts.hostname not in LOCAL_HOSTS and parts.hostname != socket.gethostname():
        raise BenchError(f"{base_url} is not on this machine: its RSS and descriptors cannot be read from here "
                         "(run the soak on the daemon's machine, or give --soak-pid)")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                return int(proc.name)
        except (PermissionError, FileNotFoundError, ProcessLookupError):
            continue  # another user's process, or one that just ended
    raise BenchError(f"no process of this user listens on port {port}: give the daemon's pid with --soak-pid")


def warmup_mark(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, Any]:
    """The first sample at or after the warm-up's end (the last one if the window is shorter): growth counts from it."""
    return next((s for s in samples if s["t_s"] >= warmup_s), samples[-1])


def criteria(samples: list[dict[str, Any]], totals: dict[str, Any], warmup_s: float,
             in_flight: dict[str, Any]) -> dict[str, Any]:
    """Each criterion's figures and whether it passed, and ``passed``: all of them. ``samples`` run from the idle
    start to the idle end, each with ``t_s``, ``rss_mib`` and ``fds``."""
    first, end = samples[0], samples[-1]
    mark = warmup_mark(samples, warmup_s)
    rss = [s["rss_mib"] for s in samples]
    out: dict[str, Any] = {
        "lost_runs": {"value": totals["lost"], "limit": 0, "passed": totals["lost"] == 0},
        "http_5xx": {"value": totals["5xx"], "limit": 0, "passed": totals["5xx"] == 0},
        "drained": {"running": in_flight["running"], "waiting": in_flight["waiting"],
                    "passed": in_flight["running"] == 0 and in_flight["waiting"] == 0},
    }
    if None in rss:  # the process went away mid-soak: nothing to compare, and a failure in itself
        out["rss_growth"] = {"growth": None, "limit": RSS_LIMIT, "passed": False, "note": "the daemon exited"}
        out["fds_flat"] = {"first": first["fds"], "last": None, "max": None, "slack": FD_SLACK, "passed": False}
    else:
        growth = (end["rss_mib"] - mark["rss_mib"]) / mark["rss_mib"]
        out["rss_growth"] = {"from_t_s": mark["t_s"], "from_mib": mark["rss_mib"], "to_mib": end["rss_mib"],
                             "max_mib": max(rss), "growth": growth, "limit": RSS_LIMIT, "passed": growth < RSS_LIMIT}
        out["fds_flat"] = {"first": first["fds"], "last": end["fds"], "max": max(s["fds"] for s in samples),
                           "slack": FD_SLACK, "passed": end["fds"] - first["fds"] <= FD_SLACK}
    out["passed"] = all(v["passed"] for v in out.values())
    return out


def growth_net_of_host_tier(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, Any] | None:
    """RSS less the host KV tier's bytes, from the warm-up's end to the end: the growth that is not a bounded cache
    filling to its budget. Reported beside the RSS criterion, not instead of it; None without the tier's figures."""
    if any(s.get("rss_mib") is None or s.get("host_tier_mib") is None for s in samples):
        return None
    end, mark = samples[-1], warmup_mark(samples, warmup_s)
    net = [s["rss_mib"] - s["host_tier_mib"] for s in samples]
    start, last = mark["rss_mib"] - mark["host_tier_mib"], net[-1]
    return {"from_t_s": mark["t_s"], "from_mib": round(start, 1), "to_mib": round(last, 1),
            "max_mib": round(max(net), 1), "growth": (last - start) / start,
            "tier_from_mib": mark["host_tier_mib"], "tier_to_mib": end["host_tier_mib"],
            "tier_budget_mib": max(s.get("host_tier_budget_mib") or 0.0 for s in samples)}


def _f(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def soak_table(soak: dict[str, Any]) -> list[str]:
    """The soak's text report: arrivals and outcomes per kind, the time series, the daemon's counts, the criteria."""
    cap = soak.get("capacity")
    rate = (f"{soak['rate']:.4f}/s ({soak['fraction']:g} x the probed capacity {cap['programs_per_s']:.4f}/s)"
            if cap else f"{soak['rate']:.4f}/s")
    lines = [f"== soak: {soak['arrivals']} arrivals over {soak['seconds']:g} s at {rate}, a sample every "
             f"{soak['sample_s']:g} s: " + ", ".join(f"{n} {k}" for k, n in soak["mix"].items()) + " =="]
    if cap:
        lines.append(f"capacity probe: {cap['window_programs']} finished in {cap['window_s']:.1f}s with "
                     f"{cap['concurrency']} closed-loop arrivals busy ({cap['failed']} failed)")
    lines.append(f"{'kind':<20} {'arrivals':>8} {'ok':>6} {'dropped':>7} {'4xx':>5} {'5xx':>5} {'lost':>5} "
                 f"{'mean s':>7} {'p95 s':>7} {'max s':>7}")
    for kind, row in [*soak["kinds"].items(), ("all", soak["totals"])]:
        lines.append(f"{kind:<20} {row['arrivals']:8d} {row['ok']:6d} {row['dropped']:7d} {row['4xx']:5d} "
                     f"{row['5xx']:5d} {row['lost']:5d} {_f(row['mean_s']):>7} {_f(row['p95_s']):>7} "
                     f"{_f(row['max_s']):>7}")
    lines.append("latencies: sent to answered, completed arrivals only (a dropped stream is not one)")
    lines.append(f"daemon process {soak['pid']} over time (start: idle before the first arrival; idle: after the "
                 "drain, the traffic's connections closed); counts so far:")
    lines.append(f"{'t s':>8} {'phase':<6} {'RSS MiB':>8} {'host tier':>9} {'malloc used':>11} {'malloc free':>11} "
                 f"{'runs kept':>9} {'runs MiB':>8} {'prefix %':>8} {'fds':>5} {'threads':>7} {'arrived':>7} "
                 f"{'done':>6} {'in flight':>9} {'errors':>6}")
    for s in soak["samples"]:
        lines.append(f"{s['t_s']:8.1f} {s['phase']:<6} {_f(s['rss_mib'], '.1f'):>8} "
                     f"{_f(s.get('host_tier_mib'), '.1f'):>9} {_f(s.get('malloc_in_use_mib'), '.1f'):>11} "
                     f"{_f(s.get('malloc_free_mib'), '.1f'):>11} {_f(s.get('run_history_runs'), 'd'):>9} "
                     f"{_f(s.get('run_history_mib'), '.1f'):>8} {_f(s.get('prefix_cache_perc'), '.1f'):>8} "
                     f"{_f(s['fds'], 'd'):>5} "
                     f"{_f(s['threads'], 'd'):>7} {s['arrived']:7d} {s['completed']:6d} {s['in_flight']:9d} "
                     f"{s['errors']:6d}")
    d = soak["daemon"]
    runs = "; ".join(f"{w} " + ", ".join(f"{n} {status}" for status, n in by.items())
                     for w, by in d["workflow_runs"].items()) or "none"
    lines.append(f"daemon: workflow runs {runs}; {d['aborted_requests']} requests aborted (dropped streams); "
                 f"{d['request_errors']} request errors")
    c = soak["criteria"]
    rss, fds, drained = c["rss_growth"], c["fds_flat"], c["drained"]
    lines.append("criteria:")
    lines.append(f"  lost runs: {c['lost_runs']['value']} (limit 0): {_verdict(c['lost_runs']['passed'])}")
    lines.append(f"  5xx answers: {c['http_5xx']['value']} (limit 0): {_verdict(c['http_5xx']['passed'])}")
    if rss["growth"] is None:
        lines.append(f"  RSS growth: {rss['note']}: FAIL")
    else:
        lines.append(f"  RSS growth from {rss['from_t_s']:g} s ({rss['from_mib']:.1f} MiB) to the end "
                     f"({rss['to_mib']:.1f} MiB, max {rss['max_mib']:.1f}): {rss['growth']:+.2%} (limit "
                     f"{rss['limit']:.0%}): {_verdict(rss['passed'])}")
    net = soak.get("rss_net_of_host_tier")
    if net is not None:
        lines.append(f"  (not judged) RSS less the host KV tier's bytes, from {net['from_t_s']:g} s "
                     f"({net['from_mib']:.1f} MiB) to the end ({net['to_mib']:.1f} MiB, max {net['max_mib']:.1f}): "
                     f"{net['growth']:+.2%}; the tier held {net['tier_from_mib']:.1f} then {net['tier_to_mib']:.1f} MiB of its "
                     f"{net['tier_budget_mib']:.1f} MiB budget")
    lines.append(f"  open descriptors idle: first {_f(fds['first'], 'd')}, last {_f(fds['last'], 'd')}, max "
                 f"{_f(fds['max'], 'd')} (the end at most {fds['slack']} above the start): {_verdict(fds['passed'])}")
    lines.append(f"  in flight after the drain: {drained['running']} running, {drained['waiting']} waiting: "
                 f"{_verdict(drained['passed'])}")
    lines.append(f"verdict: {_verdict(c['passed'])}")
    lines += [f"  error: {e}" for e in soak["errors"]]
    return lines
