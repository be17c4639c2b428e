"""The graph executor: dispatch on in-degree, streamed regions, aggregation, conditions.

One run is one task group. A node is dispatched when all its parents in its
scope are done; it awaits its inputs from the run's store, runs its primitive
through the engine's scheduler, and stores its outputs. A partial decode
starts one instance of its region (the primitives that pipelining put
downstream of it) per piece, as soon as the piece is parsed; the region's
aggregate waits for every piece of that key. A condition picks a branch; the
nodes of the other branches are never dispatched (their outputs take their
defaults). Cancelling the run cancels everything in flight and frees its KV
contexts.

A growing run (a session's semantic calls, a traced workflow) has no fixed graph:
whoever grows it adds nodes to its graph and sends their ids down the run's
``Growth``; each set runs as its own scope as soon as it arrives, reading the
values other sets produce from the one store they share. A set that fails leaves
``Failed`` in its unset outputs, so the sets that read them fail too rather than
wait. A growth with a ``driver`` (a traced workflow's body) runs it in the run's
own task group: cancelling the run cancels it, and its failure fails the run.
"""

from __future__ import annotations

import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Awaitable, Callable, MutableMapping, Protocol

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from headrace.batching.meta import Objective
from headrace.batching.resolved import ResolvedEngine
from headrace.batching.requests import VectorDrop
from headrace.graph.graph import Graph, Node, Op
from headrace.graph.events import RunEvents
from headrace.graph.objectives import objectives, task_groups
from headrace.graph.aggregates import aggregate
from headrace.graph.ops import NodeError, NotRun, OpContext, run_op
from headrace.graph.remaining import RemainingWork
from headrace.graph.store import Failed, Store

log = logging.getLogger(__name__)
COLLECTION_DROP_TIMEOUT = 60.0  # a run's end never waits forever on a stuck vector store


def new_run_id() -> str:
    """A fresh run id (the owner may put a prefix before it: ``WorkflowService.id_prefix``)."""
    return uuid.uuid4().hex[:16]


@dataclass
class NodeRecord:
    node: str
    op: str
    engine: str | None
    key: tuple
    state: str = "running"  # running | done | skipped | failed | cancelled
    started: float | None = None
    finished: float | None = None
    pieces: list[float] = field(default_factory=list)  # when a partial decode parsed each streamed piece
    op_finished: float | None = None  # a region's source: its own primitive's end (``finished`` waits for the region)

    def to_json(self, origin: float) -> dict[str, Any]:
        return {
            "node": self.node, "op": self.op, "engine": self.engine, "key": list(self.key), "state": self.state,
            "start": None if self.started is None else round(self.started - origin, 6),
            "end": None if self.finished is None else round(self.finished - origin, 6),
            "pieces": [round(t - origin, 6) for t in self.pieces],
            "op_end": None if self.op_finished is None else round(self.op_finished - origin, 6),
        }


@dataclass
class Growth:
    """What a growing run shares with whoever grows its graph (a session)."""

    additions: MemoryObjectReceiveStream[frozenset[str]]  # node sets added to the graph, in order; closed: no more
    store: Store  # the run's store: the grower sets and reads variables in it too
    # Kept current by the grower as the graph and what its outputs are awaited for change; a
    # primitive's scheduler sees the values as of its submission.
    objectives: MutableMapping[str, Objective] = field(default_factory=dict)
    task_groups: MutableMapping[str, str] = field(default_factory=dict)
    # What grows the graph from inside the run (a traced body); it closes ``additions`` when done.
    driver: Callable[[], Awaitable[None]] | None = None


@dataclass
class Run:
    workflow: str
    graph: Graph
    inputs: dict[str, Any]
    outputs: tuple[str, ...]
    id: str = field(default_factory=new_run_id)
    status: str = "queued"  # queued | running | succeeded | failed | cancelled
    result: Any = None
    error: str | None = None
    created: float = field(default_factory=time.time)
    arrival: float = field(default_factory=time.monotonic)  # what the schedulers order runs by
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    records: list[NodeRecord] = field(default_factory=list)
    cancel_scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    done: anyio.Event = field(default_factory=anyio.Event)
    events: RunEvents = field(default_factory=RunEvents)  # what it publishes (node states, streamed deltas)
    # LLM token deltas as they decode; None: the decodes of the run's outputs stream theirs as events
    on_delta: Callable[[Node, tuple, Any], Awaitable[None]] | None = None
    policy: str | None = None  # this run's batch policy, overriding the engines' own
    slo_seconds: float | None = None  # its deadline, counted from its arrival; None: none
    applied: list[tuple[str, list[str]]] = field(default_factory=list)  # what each pass changed
    isolate: bool = False  # one engine at a time: each node's duration is its batched compute alone
    owner: str | None = None  # the principal (API key digest) that created it; None: no auth
    program: str | None = None  # the program it belongs to across runs (an OpenAI request naming one)
    attained_tokens: int = 0  # tokens that program's earlier requests were served (``las`` ranks by it)
    # The cached KV its LLM calls may share (``PrimitiveMeta.cache_partition``): its key's, its salt's; "" shared.
    cache_partition: str = ""
    growth: Growth | None = None  # set: a growing run, whose node sets arrive while it runs
    # Finished and no longer among the newest: what the routes serve of it, as compressed JSON (``run_history``).
    packed: bytes | None = None
    # Finished, and past the run history's byte budget: its graph, events, passes and piece timings are gone.
    details_dropped: bool = False


def _output_deltas(run: Run) -> Callable[[Node, tuple, Any], Awaitable[None]]:
    """Stream the tokens of the decodes that write the run's outputs (the answer), as a chat stream does.

    Each delta is a ``node.partial`` event with the new text in ``delta`` (a splittable decode's
    parsed pieces are ``node.partial`` events with ``piece``). A run nobody streams drops them.
    """
    outputs = set(run.outputs)

    async def forward(node: Node, key: tuple, delta: Any) -> None:
        if delta.text and outputs.intersection(node.outputs):
            run.events.publish({"event": "node.partial", "run": run.id, "node": node.id, "key": list(key), "delta": delta.text})

    return forward


class CallObserver(Protocol):
    """Told which engines each run calls, in order (the daemon's Markov preloader learns from it)."""

    def run_started(self, run: str, workflow: str) -> None: ...

    def engine_called(self, run: str, engine: str) -> None:
        """A primitive of ``run`` is about to call ``engine``."""
        ...

    def run_ended(self, run: str, status: str) -> None: ...


class Executor:
    def __init__(self, resolve: Callable[[str], ResolvedEngine], calls: CallObserver | None = None) -> None:
        self.resolve = resolve
        self.calls = calls
        self.remaining = RemainingWork()  # what the ``deadline`` policy knows of a run's work left

    def _resolver(self, run: Run) -> Callable[[str], ResolvedEngine]:
        """How the run's primitives reach their engines: each call is also told to ``calls``."""
        calls, resolve = self.calls, self.resolve
        if calls is None:
            return resolve

        def resolve_and_tell(engine: str) -> ResolvedEngine:
            resolved = resolve(engine)
            calls.engine_called(run.id, engine)
            return resolved

        return resolve_and_tell

    async def execute(self, run: Run) -> Any:
        """Run to completion; sets the run's status, result or error. Cancellation propagates."""
        graph, growth = run.graph, run.growth
        if growth is None:
            store = Store(run.inputs, declares={v for n in graph.nodes.values() for v in n.outputs})
            deduced, groups = objectives(graph, run.outputs), task_groups(graph)
        else:
            store, deduced, groups = growth.store, growth.objectives, growth.task_groups
        ctx = OpContext(run.id, self._resolver(run), on_delta=run.on_delta or _output_deltas(run), policy=run.policy,
                        alone=EngineTurns() if run.isolate else None, arrival=run.arrival,
                        deadline=None if run.slo_seconds is None else run.arrival + run.slo_seconds,
                        objectives=deduced, task_groups=groups, remaining=self.remaining.of(run.workflow),
                        program=run.program, attained_tokens=run.attained_tokens,
                        cache_partition=run.cache_partition)
        run.status, run.started = "running", time.monotonic()
        run.events.publish({"event": "run.started", "run": run.id, "workflow": run.workflow})
        if self.calls is not None:
            self.calls.run_started(run.id, run.workflow)
        try:
            with run.cancel_scope:
                if growth is None:
                    top = {n for n, node in graph.nodes.items() if node.region is None}
                    await self._run_set(run, top, store, ctx, ())
                else:
                    await self._grow(run, growth, ctx)
                run.result = {var: store.peek(var) for var in run.outputs}
                run.status = "succeeded"
            if run.status != "succeeded":
                run.status, run.error = "cancelled", "cancelled"
        except anyio.get_cancelled_exc_class():
            run.status, run.error = "cancelled", "cancelled"
            raise
        except Exception as exc:  # the node that failed is named in the message
            cause = first_error(exc)
            run.status, run.error = "failed", str(cause) if isinstance(cause, NodeError) else f"{type(cause).__name__}: {cause}"
        finally:
            run.finished = time.monotonic()
            for record in run.records:
                if record.state == "running":
                    record.state, record.finished = "cancelled", run.finished
            with anyio.CancelScope(shield=True):
                for engine, context in list(ctx.contexts):
                    try:
                        await self.resolve(engine).llm().free(context)
                    except Exception:  # its engine failed meanwhile: the run must still end
                        log.exception("run %s: could not free context %r on %s", run.id, context, engine)
                await self._drop_collections(run, ctx)
            store.clear()
            if self.calls is not None:
                self.calls.run_ended(run.id, run.status)
            if run.status == "succeeded":
                self.remaining.observe(run.workflow, ((r.node, r.started) for r in run.records
                                                      if r.state == "done" and r.started is not None), run.finished)
                run.events.publish({"event": "run.finished", "run": run.id, "result": run.result})
            else:
                run.events.publish({"event": "run.failed", "run": run.id, "status": run.status, "error": run.error})
            run.done.set()
        return run.result

    async def _drop_collections(self, run: Run, ctx: OpContext) -> None:
        """Drop the run's own vector-store tables, through each store's scheduler (its thread, in order)."""
        for engine, collection in sorted(ctx.collections):
            try:
                with anyio.fail_after(COLLECTION_DROP_TIMEOUT):
                    await self.resolve(engine).batch().submit(VectorDrop(collection), 1, ctx.run_meta())
            except Exception:  # the run's result stands; a leftover table is only disk
                log.exception("run %s: could not drop its collection %r on %s", run.id, collection, engine)
        ctx.collections.clear()

    async def _grow(self, run: Run, growth: Growth, ctx: OpContext) -> None:
        """Run each node set added to a growing run as its own scope, until no more can come."""
        async with anyio.create_task_group() as tg, growth.additions:
            if growth.driver is not None:
                tg.start_soon(growth.driver)
            async for members in growth.additions:
                tg.start_soon(self._run_added, run, members, growth.store, ctx)

    async def _run_added(self, run: Run, members: frozenset[str], store: Store, ctx: OpContext) -> None:
        """One added set; its failure is its own: its unset outputs become ``Failed``, the run goes on."""
        try:
            await self._run_set(run, set(members), store, ctx, ())
        except Exception as exc:
            cause = first_error(exc)
            failure = Failed(str(cause) if isinstance(cause, NodeError) else f"{type(cause).__name__}: {cause}")
            for node_id in members:
                for var in run.graph.nodes[node_id].outputs:
                    if not store.has(var):
                        store.set(var, failure)

    async def _run_set(self, run: Run, members: set[str], store: Store, ctx: OpContext, key: tuple) -> None:
        """Dispatch ``members`` (one scope: the run, or one piece of a region) by in-degree."""
        graph = run.graph
        indegree = {n: len([p for p in graph.parents(n) if p in members]) for n in members}
        skipped: set[str] = set()

        async def finish(node_id: str, tg: anyio.abc.TaskGroup) -> None:
            for child in graph.children(node_id):
                if child in members:
                    indegree[child] -= 1
                    if indegree[child] == 0:
                        tg.start_soon(dispatch, child, tg)

        async def dispatch(node_id: str, tg: anyio.abc.TaskGroup) -> None:
            node = graph.nodes[node_id]
            if node_id in skipped:
                for var in node.outputs:
                    store.set(var, node.params.get("default"))
                self._record(run, node, key, "skipped")
            else:
                label = await self._run_node(run, node, store, ctx, key)
                if node.op == Op.CONDITION:
                    for branch, nodes in graph.branches.get(node_id, {}).items():
                        if branch != label:
                            skipped.update(nodes)
            await finish(node_id, tg)

        async with anyio.create_task_group() as tg:
            for n in sorted(members):
                if indegree[n] == 0:
                    tg.start_soon(dispatch, n, tg)

    async def _run_node(self, run: Run, node: Node, store: Store, ctx: OpContext, key: tuple) -> Any:
        record = self._record(run, node, key, "running")
        run.events.publish({"event": "node.started", "run": run.id, "node": node.id, "key": list(key), "engine": node.engine})
        try:
            if node.op == Op.AGGREGATE:
                outputs = {node.outputs[0]: await self._aggregate(node, store)}
            elif node.op == Op.CONDITION:
                value = await store.get(node.inputs[0])
                label = node.params["predicate"](value)
                outputs = {node.outputs[0]: ("true" if label else "false") if isinstance(label, bool) else label}
            else:
                scope = {var: await store.get(var) for var in node.inputs}
                for var in node.params.get("reads", ()):
                    scope[var] = await store.get(var)
                for var, value in scope.items():
                    if isinstance(value, Failed):
                        raise NodeError(f"node {node.id!r}: its input {var!r} failed: {value.error}")
                if any(m.region == node.id for m in run.graph.nodes.values()):
                    outputs = await self._map(run, node, record, scope, store, ctx, key)
                else:
                    async with self._alone(ctx, node, record):
                        outputs = await run_op(node, scope, ctx, key)
        except NotRun as skipped:
            record.state, record.finished = "skipped", time.monotonic()
            log.debug("run %s: %s did not run: %s", run.id, node.id, skipped.reason)
            for var in node.outputs:
                store.set(var, None)
            run.events.publish({"event": "node.skipped", "run": run.id, "node": node.id, "key": list(key),
                      "reason": skipped.reason})
            return None
        except anyio.get_cancelled_exc_class():
            record.state, record.finished = "cancelled", time.monotonic()
            raise
        except NodeError:
            record.state, record.finished = "failed", time.monotonic()
            raise
        except Exception as exc:
            record.state, record.finished = "failed", time.monotonic()
            inner = first_error(exc)
            if isinstance(inner, NodeError):  # a primitive inside this one's region failed
                raise inner from None
            raise NodeError(f"node {node.id!r} ({node.op} on {node.engine or 'no engine'}) failed: "
                            f"{type(inner).__name__}: {inner}") from exc
        for var, value in outputs.items():
            store.set(var, value)
        record.state, record.finished = "done", time.monotonic()
        run.events.publish({"event": "node.finished", "run": run.id, "node": node.id, "key": list(key),
                  "seconds": round(record.finished - record.started, 6)})
        return outputs.get(node.outputs[0]) if node.outputs else None

    @staticmethod
    @asynccontextmanager
    async def _alone(ctx: OpContext, node: Node, record: NodeRecord) -> AsyncIterator[None]:
        """In an isolated run, wait for the node's engine's turn; the node's time starts once it has it."""
        if ctx.alone is None or node.engine is None:
            yield
            return
        async with ctx.alone.turn(node.engine):
            record.started = time.monotonic()
            yield

    async def _map(self, run: Run, node: Node, record: NodeRecord, scope: dict, store: Store, ctx: OpContext,
                   key: tuple) -> dict:
        """Run the node's region once per item of its list output.

        A partial decode starts each instance as soon as its piece is parsed;
        any other node (a decode without pipelining) starts them once the list is complete.
        """
        graph = run.graph
        region = {n for n, m in graph.nodes.items() if m.region == node.id}
        collected = self._collectors(graph, node.id)
        item_var = node.outputs[0]
        declares = {v for n in region for v in graph.nodes[n].outputs}

        async with anyio.create_task_group() as tg:

            async def instance(item: Any, item_key: tuple) -> None:
                local = store.child({item_var: item}, declares)
                await self._run_set(run, region, local, ctx, item_key)
                for var, parts in collected.items():
                    parts[item_key[-1]] = local.peek(var)

            async def on_piece(_node: Node, piece: str, piece_key: tuple) -> None:
                record.pieces.append(time.monotonic())
                run.events.publish({"event": "node.partial", "run": run.id, "node": node.id, "key": list(piece_key),
                          "piece": piece})
                tg.start_soon(instance, piece, piece_key)

            streamed = node.op == Op.PARTIAL_DECODE
            async with self._alone(ctx, node, record):
                outputs = await run_op(node, scope, replace(ctx, on_piece=on_piece if streamed else None), key)
            record.op_finished = time.monotonic()
            if not streamed:
                for i, item in enumerate(outputs[item_var]):
                    tg.start_soon(instance, item, key + (i,))
        outputs[f"{node.id}.pieces"] = collected
        return outputs

    @staticmethod
    def _collectors(graph: Graph, source: str) -> dict[str, dict[int, Any]]:
        return {n.inputs[0]: {} for n in graph.nodes.values() if n.op == Op.AGGREGATE and n.params.get("source") == source}

    async def _aggregate(self, node: Node, store: Store) -> Any:
        source = node.params.get("source")
        if source is not None:  # the pieces of one streamed key, in piece order
            pieces = await store.get(f"{source}.pieces")
            parts = [v for _, v in sorted(pieces[node.inputs[0]].items())]
        else:  # stages or branches: every input, in order
            parts = [await store.get(var) for var in node.inputs]
        return aggregate(node.params.get("op", "concat"), parts, node.params)

    @staticmethod
    def _record(run: Run, node: Node, key: tuple, state: str) -> NodeRecord:
        now = time.monotonic()
        record = NodeRecord(node.id, str(node.op), node.engine, key, state, now, None if state == "running" else now)
        run.records.append(record)
        return record


class EngineTurns:
    """An isolated run's rule: one engine computes at a time.

    Primitives for the engine whose turn it is join it at once, as they would
    share its batches; the others wait until it is idle. So each primitive's
    time is its batched compute time with no other engine competing for the CPU.
    """

    def __init__(self) -> None:
        self._engine: str | None = None
        self._holders = 0
        self._changed = anyio.Condition()

    @asynccontextmanager
    async def turn(self, engine: str) -> AsyncIterator[None]:
        async with self._changed:
            while self._engine not in (None, engine):
                await self._changed.wait()
            self._engine, self._holders = engine, self._holders + 1
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):  # a cancelled holder must still hand the turn on
                async with self._changed:
                    self._holders -= 1
                    if self._holders == 0:
                        self._engine = None
                        self._changed.notify_all()


def first_error(exc: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups from task groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        nodes = [e for e in exc.exceptions if isinstance(first_error(e), NodeError)]
        exc = nodes[0] if nodes else exc.exceptions[0]
    return exc
