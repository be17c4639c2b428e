"""Workflow runs: validate, build the p-graph, optimize it, execute it, keep its record.

The daemon's REST routes and the ``headrace run`` command both drive runs
through this one service, so every run shares the engines' schedulers.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Protocol, Sequence

import anyio

from headrace.batching.resolved import ResolvedEngine
from headrace.graph import collection_refs
from headrace.graph.collection_refs import CollectionLookup, UnknownCollection
from headrace.graph.collector import ChoiceCollector, ChoiceDelta
from headrace.graph.events import EVENT_LOG, RunEvents
from headrace.graph.executor import CallObserver, Executor, Run, new_run_id
from headrace.graph.graph import Graph, Node
from headrace.graph.optimizer import Optimized, Optimizer
from headrace.graph.passes import GraphPass, PassEnv
from headrace.graph.request import request_graph
from headrace.graph.run_history import RUN_HISTORY_BYTES, RunHistory
from headrace.graph.tracing import Trace, TracePlan
from headrace.graph.workflow import MAX_TRACED_STEPS, UnknownWorkflow, Workflow, WorkflowInputError
from headrace.plugins.protocols import SamplingParams, TokenDelta


class RunObserver(Protocol):
    """Told of every workflow run that ends (plain LLM requests are not workflow runs); the daemon's metrics."""

    def run_finished(self, workflow: str, status: str, seconds: float) -> None: ...


class RequestFailed(RuntimeError):
    """An LLM request run failed; the message names the primitive and the cause."""


@dataclass(frozen=True)
class _Plan:
    """A validated run, built and optimized, not yet registered."""

    workflow: Workflow
    inputs: dict[str, Any]
    optimized: Optimized
    policy: str | None
    isolate: bool
    slo_seconds: float | None
    trace: TracePlan | None = None  # a traced workflow: its graph grows while it runs


class WorkflowService:
    """Every run's life, from validation to its record; ``async with`` the service to run anything.

    The service is an async context manager that owns the task group its runs execute in:
    leaving it cancels the runs still going (the daemon drains them first), and frees their
    engine work.
    """

    def __init__(
        self,
        workflows: Mapping[str, Workflow],
        passes: Mapping[str, GraphPass],
        resolve: Callable[[str], ResolvedEngine],
        engines_by_kind: Callable[[], dict[str, str]],
        max_efficient_batch: Callable[[str], int | None] = lambda engine: None,
        keep_runs: int = 1000,
        policies: Iterable[str] = (),
        collections: CollectionLookup | None = None,
        observer: RunObserver | None = None,
        calls: CallObserver | None = None,
        id_prefix: str = "",
        max_traced_steps: int = MAX_TRACED_STEPS,
        event_log: int = EVENT_LOG,
        run_history_bytes: int = RUN_HISTORY_BYTES,
    ) -> None:
        self.event_log = event_log  # events each run holds for its readers
        self.id_prefix = id_prefix  # starts every run id (a router in front of several daemons reads it)
        self.max_traced_steps = max_traced_steps
        self.observer = observer
        self.policies = set(policies)
        self._collections = collections
        self.workflows = dict(workflows)
        self.optimizer = Optimizer(passes)
        self.executor = Executor(resolve, calls)
        self._resolve = resolve
        self._plan_limiter: anyio.CapacityLimiter | None = None
        self._engines_by_kind = engines_by_kind
        self._max_efficient_batch = max_efficient_batch
        self.runs: OrderedDict[str, Run] = OrderedDict()
        self.history = RunHistory(self.runs, keep_runs, run_history_bytes)  # bounds ``runs`` by count and bytes
        self._runs_group: anyio.abc.TaskGroup | None = None
        self._live: dict[str, Run] = {}  # executing now: workflow runs and plain requests
        self._exit: AsyncExitStack | None = None

    async def __aenter__(self) -> WorkflowService:
        if self._exit is not None:
            raise RuntimeError("the workflow service is already open")
        async with AsyncExitStack() as stack:
            self._runs_group = await stack.enter_async_context(anyio.create_task_group())
            self._exit = stack.pop_all()
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        exit_, self._exit = self._exit, None
        assert exit_ is not None and self._runs_group is not None
        self._runs_group.cancel_scope.cancel()  # what outlived the owner's drain
        try:
            return await exit_.__aexit__(*exc_info)
        finally:
            self._runs_group = None

    def _spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        if self._runs_group is None:
            raise RuntimeError("the workflow service is not open: use `async with service:`")
        self._runs_group.start_soon(fn, *args)

    def describe(self) -> list[dict[str, Any]]:
        return [w.schema() for w in self.workflows.values()]

    def prepare(self, name: str, inputs: Any, config: Any, owner: str | None = None) -> Run:
        """Validate and build the run's e-graph; raises WorkflowInputError naming a bad field.

        ``owner``: who asks (an API key's principal, None without keys); the run is theirs, and a
        collection it names must be one they may read.
        """
        return self._register(self._plan(name, inputs, config, owner), owner)

    async def prepare_off_loop(self, name: str, inputs: Any, config: Any, owner: str | None = None) -> Run:
        """``prepare`` with the validation and the build on a worker thread, one at a time.

        Tokenizing a long question or chunking megabytes of documents takes seconds of CPU;
        one thread at a time because the optimizer's e-graph cache is not thread-safe.
        """
        if self._plan_limiter is None:
            self._plan_limiter = anyio.CapacityLimiter(1)
        plan = await anyio.to_thread.run_sync(self._plan, name, inputs, config, owner, limiter=self._plan_limiter)
        return self._register(plan, owner)

    async def _optimize_off_loop(self, pgraph: Graph, env: PassEnv, passes: Iterable[str] | None) -> Optimized:
        """A traced run's node set through the passes, on the planning thread (the e-graph cache is shared)."""
        if self._plan_limiter is None:
            self._plan_limiter = anyio.CapacityLimiter(1)
        return await anyio.to_thread.run_sync(self.optimizer.optimize, pgraph, env, passes, limiter=self._plan_limiter)

    def _plan(self, name: str, inputs: Any, config: Any, owner: str | None = None) -> _Plan:
        workflow = self.workflows.get(name)
        if workflow is None:
            raise UnknownWorkflow(name)
        inputs, config = workflow.validate(inputs, config)
        chosen = self._check_engines(config.get("engines", {}))
        engines = {**self._engines_by_kind(), **chosen, **self._collection_engines(workflow, inputs, chosen, owner)}
        for kind in workflow.kinds:
            if kind not in engines:
                raise WorkflowInputError(f"config.engines.{kind}", f"no {kind} engine is configured or ready")
        if "llm" in workflow.kinds:
            self._check_prompt_inputs(workflow, inputs, config, engines["llm"])
        passes = config.get("optimize", {}).get("passes")
        unknown = set(passes or ()) - set(self.optimizer.passes)
        if unknown:
            raise WorkflowInputError("config.optimize.passes", f"unknown pass(es) {sorted(unknown)}; "
                                     f"known: {sorted(self.optimizer.passes)}")
        policy = config.get("batch_policy")
        if policy is not None and policy not in self.policies:
            raise WorkflowInputError("config.batch_policy", f"unknown batch policy {policy!r}; known: {sorted(self.policies)}")
        if workflow.trace is not None:  # nothing to build yet: the body grows the graph as it runs
            return _Plan(workflow, inputs, Optimized(Graph(workflow.name)), policy, bool(config.get("isolate")),
                         config.get("slo_seconds"), TracePlan(config, engines, None if passes is None else tuple(passes)))
        pgraph = workflow.build(inputs, config, engines)
        env = PassEnv(max_efficient_batch=self._max_efficient_batch, inputs=set(inputs))
        optimized = self.optimizer.optimize(pgraph, env, passes)
        return _Plan(workflow, inputs, optimized, policy, bool(config.get("isolate")), config.get("slo_seconds"))

    def _check_engines(self, chosen: Mapping[str, str]) -> dict[str, str]:
        """``config.engines``: each names a ready engine of its kind (else the run would fail, or worse)."""
        for kind, name in chosen.items():
            try:
                engine = self._resolve(name).engine
            except LookupError:
                raise WorkflowInputError(f"config.engines.{kind}", f"no ready engine named {name!r}") from None
            if engine.kind != kind:
                raise WorkflowInputError(f"config.engines.{kind}", f"{name!r} is an engine of kind {engine.kind!r}, not {kind!r}")
        return dict(chosen)

    def _collection_engines(self, workflow: Workflow, inputs: dict[str, Any], chosen: Mapping[str, str],
                            owner: str | None) -> dict[str, str]:
        """A run on a persistent collection: it must exist and hold chunks, and its question is
        embedded (and searched) by the engines that indexed it, or the vectors would not compare."""
        if "collection" not in workflow.inputs or "collection" not in inputs:
            return {}
        name = inputs["collection"]
        problem = collection_refs.check_name(name)
        if problem:
            raise WorkflowInputError("inputs.collection", problem)
        info = self._collections(name, owner) if self._collections is not None else None
        if info is None:
            raise UnknownCollection(name)
        if info.chunks == 0:
            raise WorkflowInputError("inputs.collection", f"collection {name!r} holds no documents yet")
        for kind, engine in info.engines.items():
            if kind in chosen and chosen[kind] != engine:
                raise WorkflowInputError(f"config.engines.{kind}", f"collection {name!r} was indexed with "
                                         f"{engine!r}; a run on it must use that engine, not {chosen[kind]!r}")
            try:
                self._resolve(engine)
            except LookupError:
                raise WorkflowInputError("inputs.collection", f"collection {name!r} was indexed with {engine!r}, "
                                         "which is not configured or not ready") from None
        return dict(info.engines)

    def _check_prompt_inputs(self, workflow: Workflow, inputs: dict[str, Any], config: dict[str, Any],
                             llm: str) -> None:
        """Inputs that go whole into a prompt must leave the LLM room for its answer."""
        try:
            engine = self._resolve(llm).engine
        except LookupError:  # not ready: the run cannot start anyway, and says so
            return
        limit = getattr(engine, "max_context_tokens", None)
        encode = getattr(engine, "encode", None)
        if limit is None or encode is None:
            return
        answer = config.get("max_tokens", 0)
        for key in workflow.prompt_inputs:
            if isinstance(inputs.get(key), str):
                n = len(encode(inputs[key]))
                if n + answer >= limit:
                    raise WorkflowInputError(f"inputs.{key}", f"is {n} tokens; with an answer of {answer} tokens it "
                                             f"does not fit the context of {llm!r} ({limit} tokens)")

    def _register(self, plan: _Plan, owner: str | None = None) -> Run:
        run = Run(workflow=plan.workflow.name, graph=plan.optimized.graph, inputs=plan.inputs, owner=owner,
                  outputs=plan.workflow.outputs, applied=plan.optimized.applied, policy=plan.policy,
                  isolate=plan.isolate, slo_seconds=plan.slo_seconds, id=self.id_prefix + new_run_id())
        run.events = RunEvents(self.event_log)
        if plan.trace is not None:
            run.growth = Trace(run, plan.workflow.trace, plan.trace.config, plan.trace.engines, self._optimize_off_loop,
                               PassEnv(max_efficient_batch=self._max_efficient_batch), plan.trace.passes,
                               self.max_traced_steps).growth
        self.history.add(run)
        return run

    @contextmanager
    def _executing(self, run: Run) -> Iterator[None]:
        """``run`` counts as live (``cancel_all`` reaches it) while the block runs."""
        self._live[run.id] = run
        try:
            yield
        finally:
            self._live.pop(run.id, None)

    async def execute(self, run: Run) -> Run:
        try:
            with self._executing(run):
                await self.executor.execute(run)
        finally:
            if self.observer is not None:
                self.observer.run_finished(run.workflow, run.status, seconds(run))
            if run.done.is_set():
                self.history.finished(run)
        return run

    def start(self, run: Run) -> None:
        """Execute ``run`` in the service's task group; its events and ``done`` say how it goes."""
        self._spawn(self.execute, run)

    async def generate(self, engine: str, tokens: list[int], params: SamplingParams) -> AsyncIterator[TokenDelta]:
        """One LLM request's token deltas (``generate_choices`` with one prompt and one choice)."""
        async for choice in self.generate_choices(engine, [tokens], params):
            yield choice.delta

    async def generate_choices(self, engine: str, prompts: Sequence[list[int]], params: SamplingParams,
                               n: int = 1, program: str | None = None, attained_tokens: int = 0,
                               cache_partition: str = "") -> AsyncIterator[ChoiceDelta]:
        """``n`` choices per prompt as one run of prefill and decode primitives, their deltas streamed back.

        Choice ``i * n + j`` is prompt ``i``'s ``j``-th sample (vLLM's and OpenAI's numbering). With
        ``n > 1`` a prompt is prefilled once and each choice forks it (``prefill(ctx, last, parent)``),
        so the prompt's KV is computed once; with a seed, choice ``j`` samples with ``seed + j``.
        Plain OpenAI requests take this path so they share the executor, the schedulers and
        cancellation with workflows. Closing the iterator cancels the run and frees its contexts.
        ``program``: the program the request joins (None: a program of one call), whose earlier requests
        were served ``attained_tokens``; both reach the LLM scheduler in ``PrimitiveMeta``, as does
        ``cache_partition`` (the cached KV the request may reuse: ``PrimitiveMeta.cache_partition``).
        """
        built = request_graph(engine, prompts, params, n)
        graph, choice_of = built.graph, built.choice_of
        run = Run(workflow="request", graph=graph, inputs={}, outputs=(), id=self.id_prefix + new_run_id(),
                  program=program, attained_tokens=attained_tokens, cache_partition=cache_partition)
        output = ChoiceCollector()

        async def forward(node: Node, key: tuple, delta: TokenDelta) -> None:
            output.put(choice_of[node.id], delta)

        async def execute() -> None:
            try:
                with self._executing(run):
                    await self.executor.execute(run)
            finally:
                output.close()

        run.on_delta = forward
        self._spawn(execute)
        try:
            async for batch in output:
                for choice in batch:
                    yield choice
        finally:
            run.cancel_scope.cancel()  # a no-op once the run is over
        await run.done.wait()
        if run.status == "failed":
            raise RequestFailed(run.error or "the request failed")

    async def run(self, name: str, inputs: Any, config: Any = None) -> Run:
        return await self.execute(self.prepare(name, inputs, config))

    def cancel_all(self) -> None:
        """Cancel every run and plain request executing now (each frees its engine work as it ends)."""
        for run in list(self._live.values()):
            run.cancel_scope.cancel()

    def cancel(self, run_id: str) -> Run:
        run = self.runs[run_id]
        run.cancel_scope.cancel()
        return run


def seconds(run: Run) -> float:
    return (run.finished if run.finished is not None else time.monotonic()) - run.started
