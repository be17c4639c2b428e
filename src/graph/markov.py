"""Which engine a workflow calls next: a first-order Markov model over engine calls (DyOrc §5.2).

Each workflow has its own transition counts, learned online from the engine sequences of
its finished runs: ``START -> embedder -> store -> llm -> END``. Consecutive calls to the
same engine are one step (a map over chunks is one visit to the embedder). The daemon's
preloader asks it, when a run starts and after each call, which engines the run is likely to
call in its next few steps (DyOrc predicts a request's whole remaining workflow, §5.2): the
further ahead an engine is, the longer its load has to hide behind the calls before it.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from itertools import pairwise
from typing import Sequence

START = "<start>"  # the state before a run's first call
END = "<end>"  # the state after its last


@dataclass(frozen=True)
class Prediction:
    state: str  # an engine name, or END
    probability: float


class MarkovModel:
    def __init__(self) -> None:
        self._counts: defaultdict[str, defaultdict[str, Counter[str]]] = defaultdict(lambda: defaultdict(Counter))

    def learn(self, workflow: str, sequence: Sequence[str]) -> None:
        """Count the transitions of one run: ``sequence`` starts with START (and ends with END if it finished)."""
        steps = [state for i, state in enumerate(sequence) if i == 0 or state != sequence[i - 1]]
        for before, after in pairwise(steps):
            self._counts[workflow][before][after] += 1

    def predict(self, workflow: str, state: str) -> list[Prediction]:
        """The states seen after ``state`` in ``workflow``'s runs, most likely first (ties by name); [] if none."""
        row = _probabilities(self._counts.get(workflow, {}).get(state))
        ranked = sorted(row.items(), key=lambda item: (-item[1], item[0]))
        return [Prediction(name, probability) for name, probability in ranked]

    def ahead(self, workflow: str, state: str, min_probability: float, steps: int) -> list[Prediction]:
        """The engines a run now at ``state`` calls within its next ``steps`` calls with at least
        ``min_probability``, soonest first: ordered by the step at which that probability is first
        reached, then most likely first, then by name. With ``steps=1`` these are ``predict``'s
        engines at ``min_probability`` or more.

        Exact for a first-order chain: the chance of reaching a target within k steps from a state is
        the transition-weighted chance of reaching it within k - 1 from each successor.
        """
        rows = {before: _probabilities(seen) for before, seen in self._counts.get(workflow, {}).items() if seen}
        if state not in rows:
            return []
        targets = {after for row in rows.values() for after in row} - {END, state}
        found = []
        for target in targets:
            reach: dict[str, float] = {}  # within k steps, per state
            first = None  # the step at which reaching it got likely enough
            for k in range(1, steps + 1):
                reach = {before: sum(p * (1.0 if after == target else reach.get(after, 0.0)) for after, p in row.items())
                         for before, row in rows.items()}
                if first is None and reach[state] >= min_probability:
                    first = k
            if first is not None:
                found.append((first, Prediction(target, min(1.0, reach[state]))))
        found.sort(key=lambda item: (item[0], -item[1].probability, item[1].state))
        return [prediction for _, prediction in found]


def _probabilities(seen: Counter[str] | None) -> dict[str, float]:
    """One state's transition counts as probabilities ({} if none were seen)."""
    total = sum(seen.values()) if seen else 0
    return {after: n / total for after, n in seen.items()} if total else {}
