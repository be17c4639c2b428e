"""Traced (dynamic) workflows (DyOrc §4): an ``async def`` whose engine calls return handles at once.

A traced workflow's body gets a ``Trace``. Each call on it (``llm.generate``,
``llm.prefill``, ``embed``, ``search``, ``rerank``, ``tool``) adds its primitives to
the run's graph and returns a ``Handle`` to the variable they will produce, without
waiting; the body awaits a handle only where Python needs the value (a condition, a
loop bound, a string to build). A handle given to a later call is a data edge, not a
wait: ``llm.generate("...{{input:hits}}", inputs={"hits": search_handle})`` is in
the graph before the search has run.

The calls issued while the body runs without suspending are one node set. When the
body next suspends (it awaits a handle, or anything else), the set is optimized with
the run's passes, joined to the run's graph and sent down the run's ``Growth``: the
executor's growing-run machinery, which sessions use too, runs each set as soon as
it arrives. So everything issued but not awaited is in the graph, visible to the
passes, the objective deduction and the schedulers ahead of execution. The passes
see one set at a time: prefill split applies to any prompt whose inputs are not
ready yet (its ready prefix is prefilled at once), decode pipelining to a split
decode and the embeds and searches of its pieces issued in the same set, stage
decomposition to any large embed, search or rerank.

A run issues at most ``max_steps`` calls; the one past it fails the run. A call
whose primitive fails fails its handle: awaiting it raises ``CallFailed`` (the body
may catch it and go on, as the agent does with a bad tool input).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Mapping, Sequence

import anyio

from headrace.graph import collection_refs
from headrace.graph.executor import Growth, Run
from headrace.graph.graph import LLM_MAX_TOKENS, Graph, Node, Op
from headrace.graph.objectives import objectives, task_groups
from headrace.graph.ops import NodeError
from headrace.graph.optimizer import Optimized
from headrace.graph.passes import PassEnv
from headrace.graph.prompts import PLACEHOLDER, PromptTemplate
from headrace.graph.store import Failed, Store
from headrace.graph.tools import TOOLS
from headrace.plugins.protocols import JsonSchemaConstraint, SamplingParams

PENDING_SETS = 64  # node sets sent to the run not yet started (it starts each at once)
AWAITED = "awaited"  # the id of the stand-in for Python, which reads every handle (see _optimize)
SPLITS = ("lines", "json")

# (p-graph, env, enabled passes or None for all) -> the e-graph; the service runs it off the event loop
Optimize = Callable[[Graph, PassEnv, Iterable[str] | None], Awaitable[Optimized]]
# A traced workflow's body (``Workflow.trace``): issues engine calls on the trace, returns its outputs.
TraceBody = Callable[["Trace"], Awaitable[Any]]


class StepLimitExceeded(RuntimeError):
    """A traced run issued more engine calls than ``[workflows] max_traced_steps`` allows."""


class CallFailed(NodeError):
    """An awaited handle's primitive failed; the message names the node and the cause."""


class Handle:
    """The value a call will produce: ``await handle`` (or ``.text()``, ``.json()``) waits for it."""

    __slots__ = ("_trace", "var")

    def __init__(self, trace: Trace, var: str) -> None:
        self._trace, self.var = trace, var

    def __await__(self):
        return self.value().__await__()

    async def value(self) -> Any:
        await self._trace.flush()  # what was issued before this await is in the graph first
        value = await self._trace.store.get(self.var)
        if isinstance(value, Failed):
            raise CallFailed(value.error)
        return value

    async def text(self) -> str:
        value = await self.value()
        if isinstance(value, (list, tuple)):
            return "\n".join(str(v) for v in value)
        return str(value)

    def __repr__(self) -> str:
        return f"Handle({self.var!r})"


class LLMCalls:
    """``trace.llm``: prefill and generate on the run's LLM engine (``config.engines.llm``)."""

    def __init__(self, trace: Trace) -> None:
        self._trace = trace

    def generate(self, prompt: str, *, inputs: Mapping[str, Any] | None = None, max_tokens: int = LLM_MAX_TOKENS,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] = (),
                 system: str | None = None, schema: Mapping[str, Any] | None = None,
                 choices: Sequence[str] | None = None, split: str | None = None, max_pieces: int | None = None,
                 after: Handle | None = None, stream: bool = False, name: str = "generate") -> Handle:
        """A chat completion of ``prompt`` (``{{input:x}}`` placeholders filled from ``inputs``, each a
        value or a handle). ``schema``: the output is JSON matching it (constrained decoding), and
        the handle's value is the parsed JSON; ``choices``: one of these strings, constrained;
        ``split`` ("lines" or "json"): the value is the list of pieces, which decode pipelining
        can stream into embeds and searches issued with it; ``after``: a context from ``prefill``
        that this prompt continues (its KV is forked, not recomputed); ``stream``: its tokens are the
        run's ``node.partial`` events (the answer a streaming client reads as it is written).
        """
        t = self._trace
        if choices is not None:
            if schema is not None:
                raise ValueError("give schema or choices, not both")
            schema = {"type": "string", "enum": list(choices)}
        if split is not None and (split not in SPLITS or schema is not None):
            raise ValueError(f"split must be one of {SPLITS}, and not with schema or choices")
        step = t._step(name)
        nid, out, ctx = f"{name}.{step}", f"t{step}_out", f"t{step}_ctx"
        text = t._bind_prompt(prompt, inputs or {}, step)
        template = PromptTemplate(text)
        params: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                                  "seed": seed, "stop": list(stop)}
        if max_pieces is not None:
            params["max_pieces"] = max_pieces
        if schema is not None:
            constraint = JsonSchemaConstraint(json.dumps(schema, separators=(",", ":")))
            params["sampling"] = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                                seed=seed, stop=tuple(stop), constraint=constraint)
        prompt_text = text + f"{{{{output:{out}}}}}"
        prefill_params: dict[str, Any] = {"prompt": prompt_text, "system": system}
        prefill_inputs = template.inputs
        op = Op.PREFILL
        if after is not None:
            op = Op.FULL_PREFILL  # the rest of a prompt whose head ``after`` filled
            prefill_params["parent"] = t._var_of(after)
            prefill_inputs = (*prefill_inputs, t._var_of(after))
        llm = t._engine("llm")
        t._add(Node(f"{nid}.prefill", op, engine=llm, inputs=prefill_inputs, outputs=(ctx,), params=prefill_params,
                    component=name, size=max(1, len(text) // 4), prefix_hash=template.prefix_hash()))
        raw = f"t{step}_raw" if schema is not None else out
        t._add(Node(nid, Op.DECODE, engine=llm, inputs=(ctx,), outputs=(raw,), params=params, component=name,
                    splittable=split, size=max_tokens))
        if stream:
            t._streamed.add(nid)
        if schema is not None:  # the value Python and later prompts see is the parsed JSON
            t._add(Node(f"{nid}.parse", Op.FUNCTION, inputs=(raw,), outputs=(out,), params={"fn": json.loads},
                        component=name))
        return t._handle(out)

    def prefill(self, prompt: str, *, inputs: Mapping[str, Any] | None = None, system: str | None = None,
                name: str = "prefill") -> Handle:
        """Fill a KV context with ``prompt`` (the chat template's head, then the text), to be continued by
        several ``generate(..., after=context)`` calls: a shared prefix computed once."""
        t = self._trace
        step = t._step(name)
        text = t._bind_prompt(prompt, inputs or {}, step)
        template = PromptTemplate(text)
        ctx = f"t{step}_ctx"
        t._add(Node(f"{name}.{step}", Op.PARTIAL_PREFILL, engine=t._engine("llm"), inputs=template.inputs,
                    outputs=(ctx,), params={"prompt": text, "system": system}, component=name,
                    size=max(1, len(text) // 4), prefix_hash=template.prefix_hash()))
        return t._handle(ctx)


@dataclass(frozen=True)
class TracePlan:
    """What a traced run needs beyond the workflow and its inputs (the service fills it while planning)."""

    config: dict[str, Any]
    engines: Mapping[str, str]
    passes: tuple[str, ...] | None


class Trace:
    """What a traced workflow's body calls: the run's inputs and config, and its engine calls."""

    def __init__(self, run: Run, body: TraceBody, config: dict[str, Any], engines: Mapping[str, str],
                 optimize: Optimize, env: PassEnv, passes: Iterable[str] | None, max_steps: int) -> None:
        self.run = run
        self.inputs: dict[str, Any] = dict(run.inputs)
        self.config = config
        self.engines = dict(engines)  # engine kind -> engine name
        self.llm = LLMCalls(self)
        self.store = Store(dict(run.inputs), declares=set())
        self.max_steps = max_steps
        send, receive = anyio.create_memory_object_stream[frozenset[str]](PENDING_SETS)
        self.growth = Growth(receive, self.store, driver=self._drive)
        self._additions = send
        self._body = body
        self._optimize_set = optimize
        self._env = env
        self._passes = passes
        self._steps = 0
        self._pending: list[Node] = []
        self._handles: list[str] = []  # the pending set's handle variables
        self._issued = anyio.Event()
        self._flushing = anyio.Lock()
        self._streamed: set[str] = set()  # decodes whose token deltas are the run's events
        run.on_delta = self._forward_delta

    @property
    def steps(self) -> int:
        return self._steps

    # calls --------------------------------------------------------------------------

    def embed(self, texts: str | Sequence[str] | Handle, *, name: str = "embed") -> Handle:
        """The embedding engine's vectors of ``texts`` (a tensor, one row per text)."""
        step = self._step(name)
        size = len(texts) if isinstance(texts, (list, tuple)) else 1
        out = f"t{step}_out"
        self._add(Node(f"{name}.{step}", Op.EMBED, engine=self._engine("embed"),
                       inputs=(self._bind(texts, step, "texts"),), outputs=(out,), component=name, batchable=True,
                       size=size))
        return self._handle(out)

    def search(self, query: str | Sequence[str] | Handle, *, collection: str | None = None, k: int = 3,
               name: str = "search") -> Handle:
        """The ``k`` nearest chunks' texts of a persistent collection (default: ``inputs.collection``) for
        each query (a string or a list, or a handle to one): an embed, then a vector search."""
        collection = collection if collection is not None else self.inputs.get("collection")
        if not collection:
            raise ValueError("search needs a collection (the run's inputs.collection, or collection=)")
        problem = collection_refs.check_name(collection)
        if problem:
            raise ValueError(f"collection {problem}")
        step = self._step(name)
        size = len(query) if isinstance(query, (list, tuple)) else 1
        vectors, out = f"t{step}_vectors", f"t{step}_out"
        self._add(Node(f"{name}.{step}.embed", Op.EMBED, engine=self._engine("embed"),
                       inputs=(self._bind(query, step, "query"),), outputs=(vectors,), component=f"{name}.embed",
                       batchable=True, size=size))
        table = self._bind(collection_refs.table_name(collection), step, "collection")
        self._add(Node(f"{name}.{step}", Op.SEARCH, engine=self._engine("vector_store"), inputs=(vectors, table),
                       outputs=(out,), params={"k": k}, component=name, batchable=True, size=size))
        return self._handle(out)

    def rerank(self, query: str | Handle, documents: Sequence[str] | Handle, *, top_n: int = 3,
               name: str = "rerank") -> Handle:
        """The ``top_n`` of ``documents`` the reranker scores best for ``query``, best first."""
        step = self._step(name)
        out = f"t{step}_out"
        size = len(documents) if isinstance(documents, (list, tuple)) else 1
        self._add(Node(f"{name}.{step}", Op.RERANK, engine=self._engine("rerank"),
                       inputs=(self._bind(query, step, "query"), self._bind(documents, step, "documents")),
                       outputs=(out,), params={"top_n": top_n}, component=name, batchable=True, size=size))
        return self._handle(out)

    def tool(self, tool: str, argument: str | Handle, *, name: str | None = None) -> Handle:
        """One of the safe built-in tools (``TOOLS``) applied to ``argument``; a bad argument fails the call."""
        if tool not in TOOLS:
            raise ValueError(f"no tool {tool!r}; the tools are {sorted(TOOLS)}")
        name = name or tool
        step = self._step(name)
        out = f"t{step}_out"
        self._add(Node(f"{name}.{step}", Op.FUNCTION, inputs=(self._bind(argument, step, "argument"),),
                       outputs=(out,), params={"fn": TOOLS[tool], "tool": tool}, component=name))
        return self._handle(out)

    async def _forward_delta(self, node: Node, key: tuple, delta: Any) -> None:
        """A streamed generation's tokens as ``node.partial`` events, as a template's answer decode sends them."""
        if delta.text and node.id in self._streamed:
            self.run.events.publish({"event": "node.partial", "run": self.run.id, "node": node.id, "key": list(key),
                           "delta": delta.text})

    # the graph ----------------------------------------------------------------------

    def _step(self, name: str) -> int:
        """Count one call against the run's bound; the call past it fails the run."""
        if self._steps >= self.max_steps:
            raise StepLimitExceeded(f"traced workflow {self.run.workflow!r} issued more than {self.max_steps} "
                                    f"engine calls in one run (the bound is [workflows] max_traced_steps); "
                                    f"call {name!r} was refused")
        self._steps += 1
        return self._steps

    def _engine(self, kind: str) -> str:
        engine = self.engines.get(kind)
        if engine is None:
            raise ValueError(f"no {kind} engine is configured or ready for this run")
        return engine

    def _var_of(self, handle: Handle) -> str:
        if not isinstance(handle, Handle) or handle._trace is not self:
            raise ValueError(f"{handle!r} is not a handle of this run")
        return handle.var

    def _bind(self, value: Any, step: int, name: str) -> str:
        """The variable a call reads: a handle's, or a new one holding the plain value (set at once)."""
        if isinstance(value, Handle):
            return self._var_of(value)
        var = f"t{step}_{name}"
        self.store.set(var, value)
        return var

    def _bind_prompt(self, prompt: str, inputs: Mapping[str, Any], step: int) -> str:
        """``prompt`` with each ``{{input:x}}`` renamed to the run variable bound to ``inputs[x]``."""
        names = [m.group(2) for m in PLACEHOLDER.finditer(prompt) if m.group(1) == "input"]
        if any(m.group(1) == "output" for m in PLACEHOLDER.finditer(prompt)):
            raise ValueError("a traced prompt has no {{output:...}}: the call's handle is its output")
        missing = sorted(set(names) - set(inputs))
        if missing:
            raise ValueError(f"the prompt's {{{{input:...}}}} names {missing} have no value in inputs")
        bound = {key: self._bind(inputs[key], step, f"in_{key}") for key in dict.fromkeys(names)}
        return PLACEHOLDER.sub(lambda m: f"{{{{input:{bound[m.group(2)]}}}}}", prompt)

    def _add(self, node: Node) -> None:
        self._pending.append(node)
        if not self._issued.is_set():
            self._issued.set()  # the flusher sends the set once the body suspends

    def _handle(self, var: str) -> Handle:
        self._handles.append(var)
        return Handle(self, var)

    async def flush(self) -> None:
        """Optimize the calls issued since the last flush as one set, join them to the run's graph, start them.

        One flush at a time: a handle awaited while another flush optimizes must find its variable
        declared once this returns.
        """
        async with self._flushing:
            if self._pending:
                await self._send(*self._take())

    def _take(self) -> tuple[list[Node], list[str]]:
        nodes, handles = self._pending, self._handles
        self._pending, self._handles = [], []
        return nodes, handles

    async def _send(self, nodes: list[Node], handles: list[str]) -> None:
        optimized = await self._optimize(nodes, handles)
        added, graph = optimized.graph, self.run.graph
        for node in added.nodes.values():
            graph.add(node)
        graph.rewire()
        graph.compute_depths()
        top = frozenset(n for n, node in added.nodes.items() if node.region is None)
        # A set reads what earlier sets produce from the shared store: it must know they will be set.
        self.store.declares.update(v for n in top for v in graph.nodes[n].outputs)
        self.growth.objectives.clear()
        self.growth.objectives.update(objectives(graph))
        self.growth.task_groups.clear()
        self.growth.task_groups.update(task_groups(graph))
        self.run.applied.extend(optimized.applied)
        self.run.events.publish({"event": "run.grew", "run": self.run.id, "nodes": sorted(added.nodes)})
        await self._additions.send(top)

    async def _optimize(self, nodes: list[Node], handles: list[str]) -> Optimized:
        """The set's e-graph. Python reads every handle, so a stand-in node reads them while the passes
        run: a value made inside a pipelined region then gets its aggregate, as a later primitive's
        input would; the stand-in is dropped after."""
        pgraph = Graph(self.run.graph.name)
        for node in nodes:
            pgraph.add(node)
        pgraph.add(Node(AWAITED, Op.FUNCTION, inputs=tuple(handles)))
        pgraph.rewire()
        ready = {v for node in nodes for v in (*node.inputs, *node.params.get("reads", ())) if self.store.has(v)}
        env = PassEnv(max_efficient_batch=self._env.max_efficient_batch, inputs=ready)
        optimized = await self._optimize_set(pgraph, env, self._passes)
        optimized.graph.remove(AWAITED)
        return optimized

    async def _drive(self) -> None:
        """Run the body; its outputs go to the store. Calls it issued but never awaited still run."""
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._flush_when_suspended)
                result = await self._body(self)
                outputs = await self._outputs(result)
                await self.flush()
                for var, value in outputs.items():
                    self.store.set(var, value)
                tg.cancel_scope.cancel()
        finally:
            self._additions.close()

    async def _flush_when_suspended(self) -> None:
        """Send what the body issued as soon as it suspends, whatever it awaits."""
        while True:
            await self._issued.wait()
            self._issued = anyio.Event()
            await self.flush()

    async def _outputs(self, result: Any) -> dict[str, Any]:
        """The body's return value as the run's outputs: a mapping by output name, or the only output's value."""
        names = self.run.outputs
        if not isinstance(result, Mapping):
            if len(names) != 1:
                raise TypeError(f"traced workflow {self.run.workflow!r} must return a mapping of its outputs "
                                f"{list(names)}, got {type(result).__name__}")
            result = {names[0]: result}
        missing = [n for n in names if n not in result]
        if missing:
            raise TypeError(f"traced workflow {self.run.workflow!r} returned no value for output(s) {missing}")
        return {n: (await result[n]) if isinstance(result[n], Handle) else result[n] for n in names}
