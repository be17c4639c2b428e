"""Which engine a workflow calls next: a first-order Markov model over engine calls (DyOrc §5.2).

Each workflow has its own transition counts, learned online from the engine sequences of
its finished runs: ``START -> embedder -> store -> llm -> END``. Consecutive calls to the
same engine are one step (a map over chunks is one visit to the embedder). The daemon's
preloader asks it, when a run starts and after each call, which engines are likely next.
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
        seen = self._counts.get(workflow, {}).get(state)
        if not seen:
            return []
        total = sum(seen.values())
        ranked = sorted(seen.items(), key=lambda item: (-item[1], item[0]))
        return [Prediction(name, count / total) for name, count in ranked]
