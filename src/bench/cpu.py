"""How busy the CPU was meanwhile: on 2 shared cores, another process's load skews every figure."""

from __future__ import annotations

import os
from pathlib import Path
from time import perf_counter


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
