"""Parrot's semantic variables and calls (Parrot §4): a client's sessions, each one growing graph.

A session holds named variables and the calls that read and write them. A call
is a prompt template with ``{{input:x}}`` and ``{{output:y}}`` placeholders
anywhere in it; each output is one prefill and one decode, whose prompt is the
template's text before that output with every input and every earlier output
filled in (so the text after an output continues the prompt for the next one,
and the prefix cache reuses the KV they share). A call's nodes join the
session's graph, which one growing run executes (``Growth``): a call whose
inputs another call writes runs as soon as they are set, server-side, through
the same executor and LLM schedulers as any workflow. How the client awaits a
variable (``criteria``) feeds the objective deduction of the whole graph.

A session belongs to its owner (the API key digest), and closes when deleted or
after ``idle_seconds`` with no request touching it; closing cancels its work.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Literal, Mapping

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectSendStream

from headrace.batching.resolved import ResolvedEngine
from headrace.graph.executor import Executor, Growth, Run
from headrace.graph.graph import Graph, Node, Op
from headrace.graph.objectives import awaited_objectives, task_groups
from headrace.graph.prompts import PLACEHOLDER, PromptTemplate
from headrace.graph.store import Failed, Store
from headrace.plugins.protocols import SamplingParams

Criteria = Literal["latency", "throughput"]
PENDING_CALLS = 64  # calls sent to the session's run not yet started (it starts each at once)
CLOSE_WAIT_SECONDS = 10.0  # how long closing a session waits for its cancelled work to free its contexts


class SessionError(ValueError):
    """A bad request about a session's variables or calls; ``field`` names the part of the request at fault."""

    def __init__(self, field_: str, problem: str, code: str, status: int = 400) -> None:
        super().__init__(problem)
        self.field, self.code, self.status = field_, code, status


class SessionClosed(RuntimeError):
    """The session was deleted or expired while a client waited on it."""


@dataclass
class Variable:
    name: str
    producer: str | None = None  # the call that writes it; None: the client sets it
    criteria: Criteria | None = None  # how a client awaited it: latency wins over throughput


@dataclass(frozen=True)
class Call:
    id: str
    template: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    nodes: tuple[str, ...]
    created: float = field(default_factory=time.time)


@dataclass
class Session:
    id: str
    owner: str | None
    run: Run
    store: Store
    growth: Growth
    additions: MemoryObjectSendStream[frozenset[str]]
    created: float = field(default_factory=time.time)
    last_active: float = field(default_factory=time.monotonic)
    busy: int = 0  # requests on it in progress (a blocked GET keeps it alive)
    variables: dict[str, Variable] = field(default_factory=dict)
    calls: dict[str, Call] = field(default_factory=dict)
    closed: anyio.Event = field(default_factory=anyio.Event)

    # state ----------------------------------------------------------------------

    def state(self, name: str) -> tuple[str, Any]:
        """(``pending`` | ``ready`` | ``failed``, the value or the error)."""
        if not self.store.has(name):
            return "pending", None
        value = self.store.peek(name)
        return ("failed", value.error) if isinstance(value, Failed) else ("ready", value)

    def call_status(self, call: Call) -> tuple[str, str | None]:
        """(``waiting`` | ``running`` | ``succeeded`` | ``failed`` | ``cancelled``, the error if failed)."""
        states = [self.state(var) for var in call.outputs]
        failed = [error for state, error in states if state == "failed"]
        if failed:
            return "failed", failed[0]
        if all(state == "ready" for state, _ in states):
            return "succeeded", None
        if self.closed.is_set():
            return "cancelled", None
        nodes = set(call.nodes)
        started = any(r.node in nodes for r in self.run.records)
        return ("running" if started else "waiting"), None

    def call_objective(self, call: Call) -> str:
        objectives = [self.growth.objectives.get(n, "latency") for n in call.nodes]
        return "latency" if "latency" in objectives else "throughput"

    @asynccontextmanager
    async def in_use(self) -> AsyncIterator[None]:
        """A request on the session: it is not idle meanwhile, and is touched when it ends."""
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1
            self.last_active = time.monotonic()

    # variables ------------------------------------------------------------------

    def create_variable(self, name: str, value: str | None = None) -> Variable:
        if name in self.variables:
            raise SessionError("name", f"the session already has a variable {name!r}", "variable_exists", 409)
        variable = self.variables[name] = Variable(name)
        self.store.declares.add(name)
        if value is not None:
            self.store.set(name, value)
        return variable

    def variable(self, name: str) -> Variable:
        variable = self.variables.get(name)
        if variable is None:
            raise SessionError("variable", f"the session has no variable {name!r}", "variable_not_found", 404)
        return variable

    def set_variable(self, name: str, value: str) -> Variable:
        variable = self.variable(name)
        if variable.producer is not None:
            raise SessionError("variable", f"variable {name!r} is the output of call {variable.producer!r}; "
                               "it cannot be set", "variable_is_output", 409)
        if self.store.has(name):
            raise SessionError("variable", f"variable {name!r} is already set; a variable is set once",
                               "variable_already_set", 409)
        self.store.set(name, value)
        return variable

    async def wait(self, name: str, criteria: Criteria | None, timeout: float) -> Any:
        """The variable's value once it is set (a ``Failed`` if its producer failed).

        ``criteria`` tells the objective deduction what the client waits for. Raises
        TimeoutError after ``timeout`` seconds, SessionClosed if the session closes first.
        """
        variable = self.variable(name)
        if criteria is not None and variable.criteria != "latency" and variable.criteria != criteria:
            variable.criteria = criteria
            self._deduce()
        found: list[Any] = []
        with anyio.fail_after(timeout):
            async with anyio.create_task_group() as tg:

                async def value() -> None:
                    found.append(await self.store.get(name))
                    tg.cancel_scope.cancel()

                async def closed() -> None:
                    await self.closed.wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(value)
                tg.start_soon(closed)
        if not found:
            raise SessionClosed(f"session {self.id!r} closed while variable {name!r} was awaited")
        return found[0]

    # calls ----------------------------------------------------------------------

    def add_call(self, template: str, sampling: Mapping[str, SamplingParams], default: SamplingParams,
                 engine: str, system: str | None) -> Call:
        """Validate a call against the session's variables and add its nodes to the graph (not yet sent)."""
        matches = list(PLACEHOLDER.finditer(template))
        inputs = tuple(dict.fromkeys(m.group(2) for m in matches if m.group(1) == "input"))
        outputs = [m.group(2) for m in matches if m.group(1) == "output"]
        if not outputs:
            raise SessionError("template", "holds no {{output:...}} placeholder", "invalid_value")
        last = [m for m in matches if m.group(1) == "output"][-1]
        if template[last.end():].strip():
            raise SessionError("template", "has text after its last {{output:...}}: no output would read it",
                               "invalid_value")
        for name in outputs:
            if outputs.count(name) > 1:
                raise SessionError("template", f"binds the output {name!r} twice", "output_bound_twice")
        for name in sampling:
            if name not in outputs:
                raise SessionError(f"outputs.{name}", f"the template has no {{{{output:{name}}}}}", "invalid_value")
        for name in inputs:
            if name not in self.variables:
                raise SessionError("template", f"the session has no variable {name!r} (create it, or bind it as "
                                   "an earlier call's output)", "variable_not_found")
            if name in outputs:
                raise SessionError("template", f"variable {name!r} is both an input and an output of the call: "
                                   "a cycle", "cycle")
        for name in outputs:
            variable = self.variables.get(name)
            if variable is not None and variable.producer is not None:
                raise SessionError("template", f"variable {name!r} is already the output of call "
                                   f"{variable.producer!r}", "output_bound_twice", 409)
            if variable is not None and self.store.has(name):
                raise SessionError("template", f"variable {name!r} is already set; it cannot be a call's output",
                                   "variable_already_set", 409)
        call_id = f"call_{uuid.uuid4().hex[:16]}"
        nodes = _call_nodes(call_id, template, outputs, sampling, default, engine, system)
        graph = self.run.graph
        for node in nodes:
            graph.add(node)
        graph.rewire()
        try:
            graph.topo_order()
        except ValueError:
            for node in nodes:
                graph.remove(node.id)
            graph.rewire()
            raise SessionError("template", "the call's inputs depend on its own outputs through other calls: "
                               "a cycle", "cycle") from None
        for name in outputs:
            self.variables.setdefault(name, Variable(name)).producer = call_id
        self.store.declares.update(v for node in nodes for v in node.outputs)
        call = Call(call_id, template, inputs, tuple(outputs), tuple(node.id for node in nodes))
        self.calls[call_id] = call
        self._deduce()
        return call

    async def submit(self, call: Call) -> None:
        """Hand the call's nodes to the session's run, which starts them at once."""
        try:
            with anyio.CancelScope(shield=True):  # the call is in the graph: it must run, even if its client left
                await self.additions.send(frozenset(call.nodes))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise SessionClosed(f"session {self.id!r} closed while the call was submitted") from None

    def _deduce(self) -> None:
        """Depths, objectives and task groups of the whole graph, as it is now (Parrot §5.2)."""
        graph = self.run.graph
        graph.compute_depths()
        latency = [v.name for v in self.variables.values() if v.criteria == "latency"]
        throughput = [v.name for v in self.variables.values() if v.criteria == "throughput"]
        objectives, groups = awaited_objectives(graph, latency, throughput), task_groups(graph)
        self.growth.objectives.clear()
        self.growth.objectives.update(objectives)
        self.growth.task_groups.clear()
        self.growth.task_groups.update(groups)


def _call_nodes(call_id: str, template: str, outputs: list[str], sampling: Mapping[str, SamplingParams],
                default: SamplingParams, engine: str, system: str | None) -> list[Node]:
    """One prefill and one decode per output; the prompt of each is the text before its output.

    Calls of one template (the same text, whatever variables it binds) share a component name, so
    parallel ones at one depth form a task group: the maps of a map-reduce.
    """
    shape = hashlib.sha1(PLACEHOLDER.sub(r"{{\1}}", template).encode()).hexdigest()[:8]
    nodes: list[Node] = []
    seen = 0
    for m in PLACEHOLDER.finditer(template):
        if m.group(1) != "output":
            continue
        # Earlier outputs are inputs of this one's prompt; the output placeholder itself is where it stops.
        text = PLACEHOLDER.sub(lambda p: f"{{{{input:{p.group(2)}}}}}", template[: m.start()])
        prompt = PromptTemplate(text)
        params = sampling.get(m.group(2), default)
        ctx = f"{call_id}.{seen}.ctx"
        nodes.append(Node(f"{call_id}.{seen}.prefill", Op.PREFILL, engine=engine, inputs=prompt.inputs,
                          outputs=(ctx,), params={"prompt": text, "system": system},
                          component=f"call:{shape}.{seen}", prefix_hash=prompt.prefix_hash(),
                          size=max(1, len(text) // 4)))  # about 4 characters a token, as the graph builder guesses
        nodes.append(Node(f"{call_id}.{seen}.decode", Op.DECODE, engine=engine, inputs=(ctx,),
                          outputs=(m.group(2),), params={"sampling": params}, component=f"call:{shape}.{seen}",
                          size=params.max_tokens))
        seen += 1
    return nodes


class SessionManager:
    """The daemon's sessions: create, find by owner, close; expires the idle ones."""

    def __init__(self, executor: Executor, resolve: Callable[[str], ResolvedEngine],
                 engines_by_kind: Callable[[], dict[str, str]], idle_seconds: float, id_prefix: str = "") -> None:
        self.executor = executor
        self.id_prefix = id_prefix  # after "sess_": a router in front of several daemons reads it
        self.resolve = resolve
        self.engines_by_kind = engines_by_kind
        self.idle_seconds = idle_seconds
        self.sessions: dict[str, Session] = {}
        self._task_group: anyio.abc.TaskGroup | None = None

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Host the sessions' runs and expire idle sessions, until cancelled (which cancels their work)."""
        async with anyio.create_task_group() as tg:
            self._task_group = tg
            task_status.started()
            try:
                while True:
                    await anyio.sleep(min(1.0, self.idle_seconds / 4))
                    now = time.monotonic()
                    for session in list(self.sessions.values()):
                        if session.busy == 0 and now - session.last_active > self.idle_seconds:
                            tg.start_soon(self.close, session)
            finally:
                self._task_group = None
                for session in self.sessions.values():
                    session.closed.set()

    def create(self, owner: str | None) -> Session:
        if self._task_group is None:
            raise RuntimeError("the session manager is not running")
        session_id = f"sess_{self.id_prefix}{uuid.uuid4().hex[:16]}"
        send, receive = anyio.create_memory_object_stream[frozenset[str]](PENDING_CALLS)
        store = Store(declares=set())
        growth = Growth(receive, store)
        run = Run(workflow="session", graph=Graph(session_id), inputs={}, outputs=(), id=session_id, owner=owner,
                  growth=growth)
        session = Session(session_id, owner, run, store, growth, send)
        self.sessions[session_id] = session
        self._task_group.start_soon(self.executor.execute, run)
        return session

    def cancel_all(self) -> None:
        """Cancel every session's work in flight (a drain that ran out of time); the sessions stay."""
        for session in list(self.sessions.values()):
            session.run.cancel_scope.cancel()

    def get(self, session_id: str) -> Session | None:
        """The session by id, whoever made it (the daemon's routes hide another key's: ``daemon.ownership``)."""
        return self.sessions.get(session_id)

    async def close(self, session: Session) -> None:
        """Forget the session and cancel its work; returns once its contexts are freed (or after a bound)."""
        if self.sessions.pop(session.id, None) is None:
            return
        session.closed.set()
        session.run.cancel_scope.cancel()
        session.additions.close()
        with anyio.move_on_after(CLOSE_WAIT_SECONDS, shield=True):
            await session.run.done.wait()

    def llm_engine(self, name: str | None) -> str:
        """The LLM a call runs on: ``name`` if it is a ready LLM, else the first ready one."""
        if name is None:
            default = self.engines_by_kind().get("llm")
            if default is None:
                raise SessionError("model", "no LLM engine is ready", "model_not_ready", 503)
            return default
        try:
            engine = self.resolve(name).engine
        except LookupError:
            raise SessionError("model", f"the model '{name}' does not exist or is not ready", "model_not_found",
                               404) from None
        if engine.kind != "llm":
            raise SessionError("model", f"the model '{name}' is an engine of kind '{engine.kind}', not 'llm'",
                               "model_not_supported")
        return name
