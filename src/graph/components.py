"""Workflow templates: components joined with ``>>``, expanded into a p-graph.

A component names an engine role, its annotations (batchable, splittable) and
its configuration; an LLM component's prompt template declares its inputs and
output through placeholders, so data dependencies come from the prompts, not
from ``>>``. ``>>`` gives the execution order, which Ayo's Algorithm 1 keeps as
order-only edges from one component's tail primitive to the next one's head
(dependency pruning removes those that no data backs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from headrace.graph.graph import LLM_MAX_TOKENS, Graph, Node, Op
from headrace.graph.prompts import PLACEHOLDER, PromptTemplate
from headrace.graph.regions import map_over

ROLE_OPS = {
    "embed": Op.EMBED, "ingest": Op.INGEST, "search": Op.SEARCH, "text_search": Op.TEXT_SEARCH,
    "rerank": Op.RERANK, "chunk": Op.CHUNK, "condition": Op.CONDITION, "aggregate": Op.AGGREGATE,
    "function": Op.FUNCTION, "prefill": Op.PREFILL,  # a prefill alone: a KV context that others fork
}
ROLES = {"llm", *ROLE_OPS}
ENGINE_KIND = {"llm": "llm", "prefill": "llm", "embed": "embed", "ingest": "vector_store", "search": "vector_store",
               "text_search": "vector_store", "rerank": "rerank"}


@dataclass(frozen=True)
class Component:
    name: str
    role: str
    prompt: str | None = None  # llm only
    inputs: tuple[str, ...] = ()  # other roles: the variables read
    outputs: tuple[str, ...] = ()
    batchable: bool = False
    splittable: str | None = None  # "lines" or "json"
    config: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"component {self.name!r}: unknown role {self.role!r}")
        if self.role == "llm":
            template = PromptTemplate(self.prompt or "")
            if template.output is None:
                raise ValueError(f"component {self.name!r}: an LLM prompt needs an {{{{output:...}}}} placeholder")

    def __rshift__(self, other: Component | Template) -> Template:
        return Template([self]) >> other

    @property
    def reads(self) -> tuple[str, ...]:
        return PromptTemplate(self.prompt or "").inputs if self.role == "llm" else self.inputs

    @property
    def writes(self) -> tuple[str, ...]:
        return (PromptTemplate(self.prompt or "").output,) if self.role == "llm" else self.outputs


@dataclass
class Template:
    components: list[Component]

    def __rshift__(self, other: Component | Template) -> Template:
        more = other.components if isinstance(other, Template) else [other]
        return Template(self.components + more)

    def __getitem__(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(name)


def _rename_prompt(prompt: str, names: Mapping[str, str]) -> str:
    return PLACEHOLDER.sub(lambda m: "{{%s:%s}}" % (m.group(1), names.get(m.group(2), m.group(2))), prompt)


class GraphBuilder:
    """Decomposes components into primitives (Ayo Algorithm 1) for one run's inputs and config."""

    def __init__(self, name: str, engines: Mapping[str, str]) -> None:
        self.graph = Graph(name)
        self.engines = engines  # engine kind -> engine name
        self._ends: dict[str, tuple[str, str]] = {}  # component -> (head, tail) primitive ids
        self._maps: list[tuple[Node, set[str]]] = []  # (source, component names) to run per item

    def emit(self, component: Component, suffix: str = "", rename: Mapping[str, str] | None = None,
             size: int = 1, parent: str | None = None, **params: Any) -> Node:
        """Add the primitives of one instance of ``component``; returns its last primitive.

        An LLM component given ``parent``, the variable of a KV context, forks it: its prefill is a
        full prefill that continues that context. Given ``tokens``, its prompt arrives tokenized (an
        OpenAI request) and is prefilled as those tokens.
        """
        names = dict(rename or {})
        node_id = f"{component.name}{suffix}"
        config = {**component.config, **params}
        engine = self.engines.get(ENGINE_KIND.get(component.role, ""))
        if component.role == "llm":
            prompt = _rename_prompt(component.prompt or "", names)
            template = PromptTemplate(prompt)
            tokens = config.get("tokens")
            prefill_params = {**config, "prompt": prompt} if parent is None else {**config, "prompt": prompt,
                                                                                  "parent": parent}
            prefill = self.graph.add(Node(
                id=f"{node_id}.prefill", op=Op.PREFILL if parent is None else Op.FULL_PREFILL, engine=engine,
                inputs=template.inputs if parent is None else (*template.inputs, parent),
                outputs=(f"{node_id}.ctx",), params=prefill_params, component=component.name,
                # A tokenized prompt has no text to hash, and its size is known.
                size=len(tokens) if tokens is not None else max(size, len(prompt) // 4),
                prefix_hash=None if tokens is not None else template.prefix_hash(), batchable=component.batchable,
            ))
            last = self.graph.add(Node(
                id=node_id, op=Op.DECODE, engine=engine, inputs=(f"{node_id}.ctx",),
                outputs=(template.output,), params=config, component=component.name,
                splittable=component.splittable, size=config.get("max_tokens", LLM_MAX_TOKENS),
                batchable=component.batchable,
            ))
            head = prefill.id
        else:
            last = self.graph.add(Node(
                id=node_id, op=ROLE_OPS[component.role], engine=engine,
                inputs=tuple(names.get(v, v) for v in component.inputs),
                outputs=tuple(names.get(v, v) for v in component.outputs), params=config,
                component=component.name, batchable=component.batchable, size=size,
            ))
            head = last.id
        first = self._ends.get(component.name, (head, last.id))[0]
        self._ends[component.name] = (first, last.id)
        return last

    def map(self, source: Node, *components: Component) -> None:
        """Run the primitives of ``components`` once per item of ``source``'s list output.

        Applied in ``finish``, once every consumer is emitted: a region's outputs that
        later primitives read get their aggregates only if those readers exist.
        """
        self._maps.append((source, {c.name for c in components}))

    def branch(self, condition: Node, label: str, *nodes: Node) -> None:
        """``nodes`` run only when ``condition`` picks ``label``; they wait for its decision (a data edge)."""
        self.graph.branches.setdefault(condition.id, {}).setdefault(label, []).extend(n.id for n in nodes)
        for node in nodes:
            reads = tuple(node.params.get("reads", ()))
            if condition.outputs[0] not in reads:
                node.params["reads"] = (*reads, condition.outputs[0])

    def finish(self, template: Template | None = None) -> Graph:
        """Wire data edges from the variables, plus ``>>`` order edges between consecutive components.

        Without a template the graph has data edges only: its components have no ``>>`` order.
        """
        emitted = [c for c in template.components if c.name in self._ends] if template is not None else []
        for a, b in zip(emitted, emitted[1:]):
            self.graph.connect(self._ends[a.name][1], self._ends[b.name][0])
        self.graph.rewire()
        if self._maps:
            for source, names in self._maps:  # the same region machinery that pipelining uses
                map_over(self.graph, source, {n.id for n in self.graph.nodes.values() if n.component in names})
        self.graph.compute_depths()
        return self.graph
