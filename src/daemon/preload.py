"""Markov preloading (DyOrc §5.2): load the engines a run is likely to call next, before it calls them.

The ``Preloader`` is the executor's ``CallObserver``. It keeps each running run's engine
sequence; when a run starts and after each call to a new engine it asks the workflow's
Markov model for the engines the run is likely to call within its next ``preload_steps`` calls
(with at least ``preload_min_probability``), soonest first, and has the pool load those that
are not loaded, within the budget
(``EnginePool.preload``: it never unloads an engine a request waits for). When a run ends its
sequence is learned. Each call also checks the prediction made before it: the most likely
next state against the one that came, counted per workflow in ``/metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from headrace.daemon.config import ResidencyConfig
from headrace.daemon.metrics import Metrics
from headrace.daemon.pool import EnginePool
from headrace.graph.markov import END, START, MarkovModel


@dataclass
class _RunCalls:
    workflow: str
    sequence: list[str] = field(default_factory=lambda: [START])
    expected: str | None = None  # the most likely next state, as predicted after the last call


class Preloader:
    def __init__(self, pool: EnginePool, metrics: Metrics, config: ResidencyConfig,
                 workflows: Iterable[str] = ()) -> None:
        self.pool = pool
        self.metrics = metrics
        self.model = MarkovModel()
        self.min_probability = config.preload_min_probability
        self.steps = config.preload_steps
        self.enabled = config.preload and config.budget_bytes > 0
        self._runs: dict[str, _RunCalls] = {}
        # Only registered workflows are learned: a plain OpenAI request and a semantic-call session run
        # as runs too, but they are not workflows (one engine, or a client's own chain) and are not counted.
        self.workflows = frozenset(workflows)
        for workflow in self.workflows:  # exposed at 0 from the start
            metrics.markov_predictions.labels(workflow)
            metrics.markov_predictions_correct.labels(workflow)

    def run_started(self, run: str, workflow: str) -> None:
        if workflow not in self.workflows:
            return
        calls = self._runs[run] = _RunCalls(workflow)
        self.metrics.markov_predictions.labels(workflow)  # exposed at 0 once the workflow has run
        self.metrics.markov_predictions_correct.labels(workflow)
        self._next(calls)

    def engine_called(self, run: str, engine: str) -> None:
        calls = self._runs.get(run)
        if calls is None or calls.sequence[-1] == engine:
            return  # another call to the engine it is on: no transition
        self._check(calls, engine)
        calls.sequence.append(engine)
        self._next(calls)

    def run_ended(self, run: str, status: str) -> None:
        calls = self._runs.pop(run, None)
        if calls is None:
            return
        if status == "succeeded":
            self._check(calls, END)
            calls.sequence.append(END)
        if status != "cancelled":  # a cancelled run says where its client gave up, not where it goes
            self.model.learn(calls.workflow, calls.sequence)

    def _check(self, calls: _RunCalls, came: str) -> None:
        if calls.expected is not None:
            self.metrics.markov_predictions.labels(calls.workflow).inc()
            if calls.expected == came:
                self.metrics.markov_predictions_correct.labels(calls.workflow).inc()

    def _next(self, calls: _RunCalls) -> None:
        predictions = self.model.predict(calls.workflow, calls.sequence[-1])
        calls.expected = predictions[0].state if predictions else None
        if self.enabled:
            current = calls.sequence[-1]
            likely = self.model.ahead(calls.workflow, current, self.min_probability, self.steps)
            self.pool.preload([p.state for p in likely], after=None if current == START else current)
