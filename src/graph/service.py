"""Workflow runs: validate, build the p-graph, optimize it, execute it, keep its record.

The daemon's REST routes and the ``headrace run`` command both drive runs
through this one service, so every run shares the engines' schedulers.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import Any, Callable, Mapping

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from headrace.graph.executor import Executor, Run
from headrace.graph.optimizer import Optimizer
from headrace.graph.passes import GraphPass, PassEnv
from headrace.graph.workflow import Workflow, WorkflowInputError

EVENT_BUFFER = 1024  # events per subscriber; a run emits a few per node and piece


class UnknownWorkflow(KeyError):
    def __str__(self) -> str:
        return f"no workflow named {self.args[0]!r}"


class WorkflowService:
    def __init__(
        self,
        workflows: Mapping[str, Workflow],
        passes: Mapping[str, GraphPass],
        resolve: Callable[[str], tuple[Any, Any]],
        engines_by_kind: Callable[[], dict[str, str]],
        max_efficient_batch: Callable[[str], int | None] = lambda engine: None,
        keep_runs: int = 1000,
    ) -> None:
        self.workflows = dict(workflows)
        self.optimizer = Optimizer(passes)
        self.executor = Executor(resolve)
        self._engines_by_kind = engines_by_kind
        self._max_efficient_batch = max_efficient_batch
        self.runs: OrderedDict[str, Run] = OrderedDict()
        self._keep = keep_runs
        self._subscribers: dict[str, list[MemoryObjectSendStream]] = {}

    def describe(self) -> list[dict[str, Any]]:
        return [w.schema() for w in self.workflows.values()]

    def prepare(self, name: str, inputs: Any, config: Any) -> Run:
        """Validate and build the run's e-graph; raises WorkflowInputError naming a bad field."""
        workflow = self.workflows.get(name)
        if workflow is None:
            raise UnknownWorkflow(name)
        inputs, config = workflow.validate(inputs, config)
        engines = {**self._engines_by_kind(), **config.get("engines", {})}
        for kind in workflow.kinds:
            if kind not in engines:
                raise WorkflowInputError(f"config.engines.{kind}", f"no {kind} engine is configured or ready")
        passes = config.get("optimize", {}).get("passes")
        unknown = set(passes or ()) - set(self.optimizer.passes)
        if unknown:
            raise WorkflowInputError("config.optimize.passes", f"unknown pass(es) {sorted(unknown)}; "
                                     f"known: {sorted(self.optimizer.passes)}")
        pgraph = workflow.build(inputs, config, engines)
        env = PassEnv(max_efficient_batch=self._max_efficient_batch, inputs=set(inputs))
        optimized = self.optimizer.optimize(pgraph, env, passes)
        run = Run(workflow=name, graph=optimized.graph, inputs=inputs, outputs=workflow.outputs)
        run.applied = optimized.applied  # type: ignore[attr-defined]
        run.policy = config.get("batch_policy")  # type: ignore[attr-defined]
        run.emit = lambda event, _id=run.id: self._broadcast(_id, event)
        self.runs[run.id] = run
        while len(self.runs) > self._keep:
            old_id, old = next(iter(self.runs.items()))
            if old.status == "running":
                break
            del self.runs[old_id]
        return run

    async def execute(self, run: Run) -> Run:
        await self.executor.execute(run)
        return run

    async def run(self, name: str, inputs: Any, config: Any = None) -> Run:
        return await self.execute(self.prepare(name, inputs, config))

    def subscribe(self, run_id: str):
        """A receive stream of the run's events from now on (closed when the run ends)."""
        send, receive = anyio.create_memory_object_stream(EVENT_BUFFER)
        self._subscribers.setdefault(run_id, []).append(send)
        return receive

    def _broadcast(self, run_id: str, event: dict[str, Any]) -> None:
        event = {**event, "time": time.time()}
        final = event["event"] in ("run.finished", "run.failed")
        for send in list(self._subscribers.get(run_id, ())):
            try:
                send.send_nowait(event)
            except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._subscribers[run_id].remove(send)
                send.close()
            else:
                if final:
                    send.close()
        if final:
            self._subscribers.pop(run_id, None)

    def cancel(self, run_id: str) -> Run:
        run = self.runs[run_id]
        run.cancel_scope.cancel()
        return run


def timeline(run: Run) -> list[dict[str, Any]]:
    return [r.to_json(run.started) for r in run.records]


def seconds(run: Run) -> float:
    end = run.finished if run.finished is not None else time.monotonic()
    return end - run.started if math.isfinite(end) else 0.0
