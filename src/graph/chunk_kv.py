"""A collection's chunks prefilled when they are ingested, so a first retrieval is already a KV hit (issue 49).

The built-in RAG workflows put each retrieved context right after their template's fixed instruction
(``context_first``, the default): ``naive_rag``'s tree leaves and ``advanced_rag``'s refine steps each start
with one chunk. So the KV of "chat head + instruction + chunk" is an exact prefix of every later prompt that
retrieves the chunk, and it can be computed before any question arrives. ``chunk_prompts`` is that prefix for
each of those templates, tokenized as a run tokenizes it when the prefill-split pass prefills the head first
(head and rest encoded apart): the engine caches it (cells, then its KV tiers), and a run's prompt restores
it, whether it is prefilled whole or forked from an early-prefilled head (the engines rebase such a fork on a
longer cached prefix). Lossless: the same tokens at the same positions, not a placement.

Only prompts whose first input is the context qualify: the one-shot synthesis lists several contexts, of which
only the first one would be a prefix, and the question-first templates put the question before the chunk.
"""

from __future__ import annotations

from typing import Any

from headrace.graph.prompts import PLACEHOLDER, PromptTemplate, chat_frame
from headrace.graph.workflows.common import answer_context_first, refine_context_first

# The steps that start with one retrieved chunk: the tree's leaves and the refine chain's first answer
# (``answer``), and the refine chain's later steps (``refine``).
CHUNK_FIRST_STEPS = (answer_context_first, refine_context_first)


def instruction(prompt: str) -> str:
    """A chunk-first template's fixed text, which ends where its context starts."""
    first = PLACEHOLDER.search(prompt)
    if first is None or first.group(2) != "context":
        raise ValueError("a chunk-first template's first placeholder is {{input:context}}")
    return PromptTemplate(prompt).split(set())[0]


def template_heads(engine: Any) -> list[list[int]]:
    """The chat head and instruction of each chunk-first step, tokenized as a run's early prefill tokenizes it."""
    head, _ = chat_frame(engine, None)
    return [list(engine.encode(head + instruction(step.prompt))) for step in CHUNK_FIRST_STEPS]


def chunk_prompts(engine: Any, chunk: str, heads: list[list[int]] | None = None) -> list[list[int]]:
    """The token prefixes a run of a built-in RAG workflow on ``engine`` starts with when it retrieves ``chunk``,
    one per chunk-first step: the chat head and instruction (``heads``, from ``template_heads``: pass them when
    making many), then the chunk (its last tokens may merge with the question's in a run; the engine's cache
    matches block by block, so a hit stops a block short at most)."""
    body = list(engine.encode(chunk))
    return [head + body for head in (heads if heads is not None else template_heads(engine))]
