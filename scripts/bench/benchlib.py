"""What the benchmark scripts share: CPU-contention watch, small statistics, writing results."""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
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


def cpu_name() -> str:
    """The CPU's model name, its cores, and its AMX flags (or "no AMX"): what every figure is named with."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    except OSError:
        name = platform.processor() or "?"
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    amx = sorted(set(re.findall(r"\bamx_\w+", flags)))
    return f"{name}, {os.cpu_count()} cores" + (f", {' '.join(amx)}" if amx else ", no AMX")


def cpu_note(section: dict) -> str:
    other = section["cpu_cores"]["other_processes"]
    return f"other processes used {other:.2f} cores meanwhile" + ("  ** CONTENDED: unreliable **" if other > 0.2 else "")


def write_results(res: dict, out: Path, t_start: float) -> None:
    """Stamp the run, write it as JSON under bench-results/, and say where."""
    res["meta"] = {"python": sys.version.split()[0], "cpus": os.cpu_count(), "elapsed_s": perf_counter() - t_start,
                   "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
