"""What the benchmark scripts share: CPU-contention watch, small statistics, writing results."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from time import perf_counter

ROOT = Path(__file__).resolve().parents[2]


class CPUWatch:
    """CPU used meanwhile, in cores: by this process, by ``pids``, and by everyone else.

    The machine has 2 cores: another process's load skews every figure, so it is reported.
    """

    def __init__(self, pids=()) -> None:
        self.pids = pids
        self.t0, self.start = perf_counter(), self._ticks()

    def _ticks(self) -> tuple[int, ...]:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        procs = [Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split() for p in ("self", *self.pids)]
        return (sum(f) - f[3] - f[4], *(int(s[11]) + int(s[12]) for s in procs))  # busy; utime+stime each

    def cores(self) -> dict[str, float]:
        scale = os.sysconf("SC_CLK_TCK") * (perf_counter() - self.t0)
        busy, own, *others = [b - a for a, b in zip(self.start, self._ticks())]
        return {"self": own / scale, "pids": sum(others) / scale,
                "other_processes": max(0, busy - own - sum(others)) / scale}


def median(xs) -> float:
    return statistics.median(xs) if xs else 0.0


def mean(xs) -> float:
    return statistics.fmean(xs) if xs else 0.0


def cpu_note(section: dict) -> str:
    other = section["cpu_cores"]["other_processes"]
    return f"other processes used {other:.2f} cores meanwhile" + ("  ** CONTENDED: unreliable **" if other > 0.2 else "")


def write_results(res: dict, out: Path, t_start: float) -> None:
    """Stamp the run, write it as JSON under bench-results/, and say where."""
    res["meta"] = {"python": sys.version.split()[0], "cpus": os.cpu_count(), "elapsed_s": perf_counter() - t_start,
                   "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
