"""M/G/1 mean response times under processor sharing, FCFS and SRPT, for a discrete job-size distribution.

What ordering alone could win on a workload, as a bound for the scheduling benchmarks: an LLM engine
that batches every waiting request serves programs about as processor sharing does (vLLM's per-request
FCFS with continuous batching), and no policy, even one that knows each program's size in advance, does
better on the mean than shortest remaining processing time first (SRPT is optimal for the mean; Schrage
1968). The bound is optimistic for reordering: it lets a reordered engine keep a full batch's throughput.

Formulas (Harchol-Balter, *Performance Modeling and Design of Computer Systems*, 2013: ch. 22 and 33),
sizes as atoms, so SRPT's waiting term is the preemptive-priority form where a size is a class (jobs of
the same size are served first come first served among themselves):

- PS: ``E[T] = E[S] / (1 - rho)`` (insensitive to the distribution);
- FCFS: ``E[T] = E[S] + lambda E[S^2] / (2 (1 - rho))`` (Pollaczek-Khinchine);
- SRPT: ``E[T(x)] = (lambda/2)(sum_{s<=x} s^2 p_s + x^2 P(S>x)) / ((1 - rho(<x))(1 - rho(<=x)))
  + integral_0^x dt / (1 - rho(<t))``, where ``rho(<t)`` is the load of jobs smaller than ``t``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class MeanResponse:
    """Mean response time of each discipline, in the sizes' unit."""

    load: float
    ps: float
    fcfs: float
    srpt: float


def mean_responses(sizes: Mapping[float, float], load: float) -> MeanResponse:
    """Mean response times at ``load`` (utilisation) for jobs whose sizes are ``sizes``: size -> probability."""
    if not 0 < load < 1:
        raise ValueError(f"load must be between 0 and 1 (exclusive), not {load}")
    total = sum(sizes.values())
    if total <= 0 or any(s <= 0 or q < 0 for s, q in sizes.items()):
        raise ValueError("sizes must be positive, with probabilities >= 0 that do not all vanish")
    atoms = sorted((s, q / total) for s, q in sizes.items() if q > 0)
    mean = sum(s * q for s, q in atoms)
    second = sum(s * s * q for s, q in atoms)
    rate = load / mean

    def load_below(x: float, inclusive: bool) -> float:
        return rate * sum(s * q for s, q in atoms if s < x or (inclusive and s == x))

    def srpt(x: float) -> float:
        residual = rate / 2 * (sum(s * s * q for s, q in atoms if s <= x) + x * x * sum(q for s, q in atoms if s > x))
        waiting = residual / ((1 - load_below(x, False)) * (1 - load_below(x, True)))
        served, start = 0.0, 0.0  # once started, only arrivals smaller than its remaining work preempt it
        for s, _ in atoms:
            if s > x:
                break
            served += (s - start) / (1 - load_below(s, False))
            start = s
        return waiting + served

    return MeanResponse(load, mean / (1 - load), mean + rate * second / (2 * (1 - load)),
                        sum(srpt(s) * q for s, q in atoms))


def squared_cv(sizes: Mapping[float, float]) -> float:
    """The squared coefficient of variation of the sizes: 1 for exponential, 0 for one size; above 1 is where
    favouring the least attained service pays."""
    total = sum(sizes.values())
    mean = sum(s * q for s, q in sizes.items()) / total
    return sum(s * s * q for s, q in sizes.items()) / total / mean ** 2 - 1
