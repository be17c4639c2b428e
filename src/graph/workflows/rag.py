"""naive_rag and advanced_rag (Ayo's document-QA pipelines)."""

from __future__ import annotations

from typing import Any, Mapping

from headrace.graph import collection_refs
from headrace.graph.components import Component, GraphBuilder, Template
from headrace.graph.workflow import Workflow
from headrace.graph.workflows import common
from headrace.graph.workflows.common import (CHUNK_CONFIG, COLLECTION, CONTEXT_FIRST, DOCUMENTS, PLACE_DOCUMENTS,
                                             QUESTION, SYNTHESIS_MODES)

embed_question = Component("embed_question", "embed", inputs=("question",), outputs=("question_vector",),
                           batchable=True)
search = Component("search", "search", inputs=("question_vector", "collection"), outputs=("contexts",),
                   batchable=True)

RAG_INPUTS = {"question": QUESTION, "documents": DOCUMENTS, "collection": COLLECTION}


def index_or_collection(b: GraphBuilder, inputs: dict[str, Any], config: dict[str, Any]) -> list[Component]:
    """Index the run's documents, or point the search at a persistent collection (no indexing then).

    Returns the indexing components the run's template holds. The service has already checked
    that the collection exists (and chosen the engines that embedded it).
    """
    if collection_refs.source(inputs, "documents") == "documents":
        common.index(b, inputs, config)
        return [common.chunk, common.embed_chunks, common.ingest]
    inputs["collection"] = collection_refs.table_name(inputs["collection"])  # the search reads it as a variable
    return []


def build_naive(inputs: dict[str, Any], config: dict[str, Any], engines: Mapping[str, str]):
    b = GraphBuilder("naive_rag", engines)
    indexing = index_or_collection(b, inputs, config)
    b.emit(embed_question)
    b.emit(search, k=config["top_k"])
    synth = common.synthesize(b, config["synthesis"], "contexts", config["top_k"], config)
    return b.finish(Template([*indexing, embed_question, search, *synth]))


NAIVE = Workflow(
    name="naive_rag",
    description="Chunk, embed and index the documents (or use a collection); retrieve the top chunks for the question; tree synthesis.",
    inputs=RAG_INPUTS,
    required=("question",),
    config={**CHUNK_CONFIG, **CONTEXT_FIRST, **PLACE_DOCUMENTS, "top_k": {"type": "integer", "minimum": 1, "maximum": 16, "default": 3},
            "synthesis": {"type": "string", "enum": list(SYNTHESIS_MODES), "default": "tree"}},
    build=build_naive,
    kinds=("llm", "embed", "vector_store"),
)

EXPAND = ("Write {{input:n_queries}} short search queries that would find information to answer the question. "
          "Write one query per line, with no numbering and nothing else.\n"
          "Question: {{input:question}}\nQueries:\n{{output:queries}}")
expand = Component("expand", "llm", prompt=EXPAND, splittable="lines")
embed_queries = Component("embed_queries", "embed", inputs=("queries",), outputs=("query_vectors",), batchable=True)
search_queries = Component("search_queries", "search", inputs=("query_vectors", "collection"),
                           outputs=("candidates",), batchable=True)
merge = Component("merge", "function", inputs=("contexts", "candidates"), outputs=("pool",),
                  config={"fn": lambda a, b: list(dict.fromkeys([*a, *b]))})
rerank = Component("rerank", "rerank", inputs=("question", "pool"), outputs=("top",), batchable=True)


def build_advanced(inputs: dict[str, Any], config: dict[str, Any], engines: Mapping[str, str]):
    b = GraphBuilder("advanced_rag", engines)
    indexing = index_or_collection(b, inputs, config)
    inputs["n_queries"] = str(config["n_queries"])  # a prompt input
    b.emit(expand, max_tokens=16 * config["n_queries"], max_pieces=config["n_queries"])
    b.emit(embed_queries, size=config["n_queries"])
    b.emit(search_queries, k=config["k_per_query"], size=config["n_queries"])
    # The question itself is always searched too: a small model's expansion may yield nothing usable.
    b.emit(embed_question)
    b.emit(search, k=config["k_per_query"])
    b.emit(merge)
    b.emit(rerank, top_n=config["top_n"], size=config["k_per_query"] * (config["n_queries"] + 1))
    synth = common.synthesize(b, config["synthesis"], "top", config["top_n"], config)
    return b.finish(Template([*indexing, expand, embed_queries,
                              search_queries, embed_question, search, merge, rerank, *synth]))


ADVANCED = Workflow(
    name="advanced_rag",
    description="Query expansion (streamed line by line), multi-query retrieval, rerank, refine synthesis.",
    inputs=RAG_INPUTS,
    required=("question",),
    config={**CHUNK_CONFIG, **CONTEXT_FIRST, **PLACE_DOCUMENTS,
            "n_queries": {"type": "integer", "minimum": 1, "maximum": 8, "default": 3},
            "k_per_query": {"type": "integer", "minimum": 1, "maximum": 64, "default": 16},
            "top_n": {"type": "integer", "minimum": 1, "maximum": 16, "default": 3},
            "synthesis": {"type": "string", "enum": list(SYNTHESIS_MODES), "default": "refine"}},
    build=build_advanced,
    kinds=("llm", "embed", "vector_store", "rerank"),
)
