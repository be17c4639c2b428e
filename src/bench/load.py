"""Open-loop load: Poisson arrivals at a fixed rate for a fixed time, and what came of them.

Requests arrive on a schedule drawn from the seed whether or not earlier ones
have finished (open loop, as real clients do), so a system slower than the
offered rate builds a queue and its latency grows. After the arrival window the
driver waits for stragglers up to ``drain_s``; one still running then is
cancelled and counts as a miss.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import anyio


def arrivals(rate: float, duration: float, seed: int, count: int | None = None) -> list[float]:
    """Poisson arrival times: exponential gaps of mean 1/rate, in [0, duration), or the first ``count``."""
    if rate <= 0 or (count is None and duration <= 0) or (count is not None and count < 1):
        raise ValueError("rate, and duration or count, must be > 0")
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if (count is None and t >= duration) or (count is not None and len(out) == count):
            return out
        out.append(t)


@dataclass
class Sample:
    arrival: float  # seconds from the load's start
    latency: float | None = None  # None: failed or cancelled
    error: str | None = None
    tag: str = ""  # which workload of a mixed load


@dataclass
class LoadResult:
    rate: float
    duration: float
    slo_s: float
    samples: list[Sample] = field(default_factory=list)
    makespan: float = 0.0

    def summary(self, tag: str | None = None, slo_s: float | None = None) -> dict[str, Any]:
        """Latency percentiles, throughput and goodput (completions within the SLO per second)."""
        slo_s = self.slo_s if slo_s is None else slo_s
        samples = [s for s in self.samples if tag is None or s.tag == tag]
        done = sorted(s.latency for s in samples if s.latency is not None)
        good = sum(1 for x in done if x <= slo_s)
        window = max(self.makespan, self.duration)
        return {
            "rate": self.rate, "duration_s": self.duration, "slo_s": slo_s, "offered": len(samples),
            "completed": len(done), "failed": len(samples) - len(done),
            "mean_s": statistics.fmean(done) if done else None, "p50_s": percentile(done, 50),
            "p95_s": percentile(done, 95), "p99_s": percentile(done, 99),
            "throughput": len(done) / window, "goodput": good / window, "slo_attainment": good / len(samples) if samples else 0.0,
            "errors": sorted({s.error for s in samples if s.error})[:3],
            # Each request in arrival order (None: failed): goodput at another SLO, or who made it, from these.
            "arrivals_s": [round(s.arrival, 3) for s in samples],
            "latencies_s": [None if s.latency is None else round(s.latency, 3) for s in samples],
        }


def percentile(sorted_xs: list[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_xs:
        return None
    k = (len(sorted_xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (k - lo)


Request = Callable[[int], Awaitable[Any]]  # request index -> awaitable of its completion


async def poisson(requests: dict[str, Request], rate: float, duration: float, slo_s: float, seed: int,
                  drain_s: float, count: int | None = None) -> LoadResult:
    """Offer ``rate`` req/s for ``duration`` s (or for ``count`` arrivals), spread evenly over the ``requests``
    kinds (tags)."""
    times = arrivals(rate, duration, seed, count)
    if count is not None:
        duration = times[-1]  # the arrival window
    tags = list(requests)
    result = LoadResult(rate, duration, slo_s)
    t0 = time.perf_counter()

    async def one(i: int, sample: Sample) -> None:
        start = time.perf_counter()
        try:
            await requests[sample.tag](i)
        except Exception as exc:  # the sample records it; the load goes on
            sample.error = f"{type(exc).__name__}: {exc}"[:300]
        else:
            sample.latency = time.perf_counter() - start

    async with anyio.create_task_group() as tg:
        for i, at in enumerate(times):
            await anyio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            sample = Sample(at, tag=tags[i % len(tags)])
            result.samples.append(sample)
            tg.start_soon(one, i, sample)
        with anyio.move_on_after(max(0.0, duration - (time.perf_counter() - t0)) + drain_s) as drained:
            while any(s.latency is None and s.error is None for s in result.samples):
                await anyio.sleep(0.05)
        if drained.cancelled_caught:  # stragglers: cancelled, so their engine work is freed
            for s in result.samples:
                if s.latency is None and s.error is None:
                    s.error = "not finished when the drain time ran out"
            tg.cancel_scope.cancel()
    result.makespan = time.perf_counter() - t0
    return result
