"""Pieces the built-in workflows share: indexing and the three synthesis modes."""

from __future__ import annotations

from typing import Any

from headrace.graph.components import Component, GraphBuilder
from headrace.graph.ops import chunk_text
from headrace.graph.workflow import WorkflowInputError

SYNTHESIS_MODES = ("tree", "refine", "one_shot")

# Each family of workflows has its own usual answer length, so each has its own max_tokens default.
RAG_MAX_TOKENS = 96  # an answer from retrieved context
SHORT_ANSWER_MAX_TOKENS = 48  # the search and dynamic workflows: a short answer, a verdict, a step
SUMMARY_MAX_TOKENS = 64  # each map, reduce or chain step of a summary


def max_tokens_option(default: int, description: str = "tokens per LLM answer") -> dict[str, Any]:
    """A workflow's ``max_tokens`` config option (JSON schema)."""
    return {"type": "integer", "minimum": 1, "maximum": 1024, "default": default, "description": description}


CHUNK_CONFIG = {
    "chunk_size": {"type": "integer", "minimum": 16, "maximum": 1024, "default": 256,
                   "description": "words per chunk"},
    "chunk_overlap": {"type": "integer", "minimum": 0, "maximum": 1023, "default": 30,
                      "description": "words shared by neighbours; less than chunk_size"},
    "max_tokens": max_tokens_option(RAG_MAX_TOKENS),
}
DOCUMENTS = {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1}
QUESTION = {"type": "string", "minLength": 1}
# A run given a collection searches it instead of indexing documents of its own.
COLLECTION = {"type": "string", "minLength": 1, "maxLength": 64,
              "description": "a persistent collection (POST /v1/collections) to search instead of indexing "
                             "the run's documents"}

chunk = Component("chunk", "chunk", inputs=("documents",), outputs=("chunks",))
embed_chunks = Component("embed_chunks", "embed", inputs=("chunks",), outputs=("chunk_vectors",), batchable=True)
ingest = Component("ingest", "ingest", inputs=("chunk_vectors", "chunks"), outputs=("collection",), batchable=True)


def count_chunks(inputs: dict[str, Any], field: str, config: dict[str, Any]) -> int:
    """How many chunks ``inputs[field]`` makes (the p-graph's sizes); a bad split names the field."""
    if config["chunk_overlap"] >= config["chunk_size"]:
        raise WorkflowInputError("config.chunk_overlap", "must be smaller than config.chunk_size")
    n = len(chunk_text(inputs[field], config["chunk_size"], config["chunk_overlap"]))
    if n == 0:
        raise WorkflowInputError(f"inputs.{field}", "has no words")
    return n


def index(b: GraphBuilder, inputs: dict[str, Any], config: dict[str, Any]) -> int:
    """Chunk, embed and ingest the run's documents; returns the number of chunks."""
    n = count_chunks(inputs, "documents", config)
    b.emit(chunk, size=n, words=config["chunk_size"], overlap=config["chunk_overlap"])
    b.emit(embed_chunks, size=n)
    b.emit(ingest, size=n)
    return n


def split_list(name: str, source: str, n: int) -> Component:
    """A function primitive that spreads a list over ``n`` variables (missing ones are empty)."""
    return Component(name, "function", inputs=(source,), outputs=tuple(f"{source}_{i}" for i in range(n)),
                     config={"fn": lambda items: tuple((list(items) + [""] * n)[:n])})


ANSWER = ("Answer the question using the context.\nQuestion: {{input:question}}\n"
          "Context:\n{{input:context}}\nAnswer: {{output:answer}}")
REFINE = ("Refine the answer to the question with the new context.\nQuestion: {{input:question}}\n"
          "Existing answer: {{input:previous}}\nNew context:\n{{input:context}}\nRefined answer: {{output:answer}}")
COMBINE_HEAD = "Combine these answers to the question into one answer.\nQuestion: {{input:question}}\n"
ONE_SHOT = ("Answer the question using the contexts.\nQuestion: {{input:question}}\n"
            "Contexts:\n{{input:contexts}}\nAnswer: {{output:answer}}")

answer = Component("answer", "llm", prompt=ANSWER)
refine = Component("refine", "llm", prompt=REFINE)
one_shot = Component("answer", "llm", prompt=ONE_SHOT)
# The same prompts with the context before the question (RAGCache's order): a retrieved chunk then starts
# the prompt after the fixed instruction, so its KV is an exact prefix the engine's cache and KV tiers find
# in every later prompt that retrieves it. The default since 2026-11-29: on `headrace bench rag-qa`'s
# extractive questions it answered better, not worse (docs/benchmarks.md#rag-prompt-layout-task-score-rag-qa).
CONTEXT_FIRST = {
    "context_first": {"type": "boolean", "default": True,
                      "description": "put each retrieved context before the question, so a chunk's KV is "
                                     "reused across queries as an exact prefix"},
}
answer_context_first = Component("answer", "llm", prompt=(
    "Answer the question using the context.\nContext:\n{{input:context}}\nQuestion: {{input:question}}\n"
    "Answer: {{output:answer}}"))
refine_context_first = Component("refine", "llm", prompt=(
    "Refine the answer to the question with the new context.\nNew context:\n{{input:context}}\n"
    "Question: {{input:question}}\nExisting answer: {{input:previous}}\nRefined answer: {{output:answer}}"))
one_shot_context_first = Component("answer", "llm", prompt=(
    "Answer the question using the contexts.\nContexts:\n{{input:contexts}}\nQuestion: {{input:question}}\n"
    "Answer: {{output:answer}}"))
# Unset, placement follows context_first: in that layout it holds issue 49's quality bar (KL 0.02-0.03, top-1
# 91%, rag-qa F1 +0.2 against the same tokens prefilled); with the question first it lost 11.6 F1.
PLACE_DOCUMENTS = {
    "place_documents": {"type": "boolean",
                        "description": "place each retrieved context's KV, computed once at ingest, where it stands "
                                       "in the prompt instead of prefilling it (an engine with place_documents "
                                       "on; close to a full prefill, not equal: docs/benchmarks.md); unset: as "
                                       "context_first"},
}
STEPS = {False: (answer, refine, one_shot),
         True: (answer_context_first, refine_context_first, one_shot_context_first)}  # by context_first


def synthesize(b: GraphBuilder, mode: str, contexts: str, n: int, config: dict[str, Any], fan_in: int = 3) -> list[Component]:
    """Emit the synthesis over ``n`` contexts in ``contexts``; the final text lands in ``answer``."""
    llm = {"max_tokens": config["max_tokens"]}
    context_first = bool(config.get("context_first"))
    answer, refine, one_shot = STEPS[context_first]
    place = bool(config.get("place_documents", context_first))

    def placed(variable: str) -> dict[str, str]:  # the prompt's documents, for an engine that places them
        return {"placed_documents": variable} if place else {}

    if mode == "one_shot" or n <= 1:
        b.emit(one_shot, rename={"contexts": contexts}, **llm, **placed(contexts))
        return [one_shot]
    spread = split_list("spread", contexts, n)
    b.emit(spread)
    if mode == "refine":
        b.emit(answer, suffix="_0", rename={"context": f"{contexts}_0", "answer": "answer_0"}, **llm,
               **placed(f"{contexts}_0"))
        for i in range(1, n):
            last = "answer" if i == n - 1 else f"answer_{i}"
            b.emit(refine, suffix=f"_{i}", rename={"context": f"{contexts}_{i}", "previous": f"answer_{i - 1}",
                                                   "answer": last}, **llm, **placed(f"{contexts}_{i}"))
        return [spread, answer, refine]
    # tree: one leaf per context, then combine fan_in at a time until one answer remains
    level = [f"leaf_{i}" for i in range(n)]
    for i in range(n):
        b.emit(answer, suffix=f"_{i}", rename={"context": f"{contexts}_{i}", "answer": level[i]}, **llm,
               **placed(f"{contexts}_{i}"))
    depth = 0
    while len(level) > 1:
        groups = [level[i : i + fan_in] for i in range(0, len(level), fan_in)]
        nxt = []
        for g, group in enumerate(groups):
            out = "answer" if len(groups) == 1 else f"tree_{depth}_{g}"
            body = "".join(f"Answer {j + 1}: {{{{input:{v}}}}}\n" for j, v in enumerate(group))
            combine = Component(f"combine_{depth}_{g}", "llm", prompt=COMBINE_HEAD + body + f"Combined answer: {{{{output:{out}}}}}")
            b.emit(combine, **llm)
            nxt.append(out)
        level, depth = nxt, depth + 1
    return [spread, answer]
