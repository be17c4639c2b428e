"""A plain OpenAI request as a graph, built by ``GraphBuilder`` like any template's.

Each prompt's choices are LLM components whose prompt arrives tokenized. With
``n > 1`` the prompt is prefilled once (a prefill component) and each choice forks
it, so the prompt's KV is computed once. Every choice is a component of its own:
the choices of one request are not a task group (a template's instances of one
component would be).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from headrace.graph.components import Component, GraphBuilder
from headrace.graph.graph import Graph
from headrace.plugins.protocols import SEED_MAX, SEED_MIN, SamplingParams

# The choice's answer: its whole prompt is the request's tokens.
CHOICE_PROMPT = "{{output:text}}"


def choice_params(params: SamplingParams, j: int) -> SamplingParams:
    """The sampling of a request's ``j``-th choice: a seeded request gives each choice its own seed (vLLM's
    ``seed + j``, wrapped into the seeds a generator takes)."""
    if params.seed is None or j == 0:
        return params
    span = SEED_MAX - SEED_MIN + 1
    return replace(params, seed=(params.seed + j - SEED_MIN) % span + SEED_MIN)


@dataclass(frozen=True)
class RequestGraph:
    graph: Graph
    choice_of: dict[str, int]  # decode node id -> its choice's index


def request_graph(engine: str, prompts: Sequence[list[int]], params: SamplingParams, n: int = 1) -> RequestGraph:
    """The primitives of ``n`` choices per prompt; choice ``i * n + j`` is prompt ``i``'s ``j``-th sample."""
    builder = GraphBuilder("request", {"llm": engine})
    choice_of: dict[str, int] = {}
    for i, tokens in enumerate(prompts):
        # A one-token prompt has no prefix to share: each choice prefills it whole.
        fork = n > 1 and len(tokens) > 1
        shared = f"p{i}.prefix.ctx"
        if fork:
            prefix = Component(f"p{i}.prefix", "prefill", outputs=(shared,))
            builder.emit(prefix, size=len(tokens) - 1, tokens=tokens[:-1])
        for j in range(n):
            index = i * n + j
            choice = Component(f"c{index}", "llm", prompt=CHOICE_PROMPT)
            decode = builder.emit(choice, rename={"text": f"c{index}_text"}, parent=shared if fork else None,
                                  tokens=tokens[-1:] if fork else tokens, sampling=choice_params(params, j),
                                  max_tokens=params.max_tokens)
            choice_of[decode.id] = index
    return RequestGraph(builder.finish(), choice_of)
