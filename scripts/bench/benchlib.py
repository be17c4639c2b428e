"""What the benchmark scripts share: CPU-contention watch, small statistics, writing results."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from time import perf_counter

from headrace.bench.cpu import CPUWatch  # noqa: F401  (the scripts import it from here)

ROOT = Path(__file__).resolve().parents[2]


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
