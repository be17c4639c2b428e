"""fact_verify: FacTool-style verification (ALTO Figure 1).

answer -> claims (a JSON list, constrained) -> per claim: search queries (one per line) ->
per query: full-text search -> evidence per claim -> a verdict per claim.
Without passes, each claim's work starts once all claims are written; with
decode pipelining, a claim's queries start as soon as its line is complete,
and each query's search as soon as the query is.
"""

from __future__ import annotations

from typing import Any, Mapping

from headrace.graph.components import Component, GraphBuilder, Template
from headrace.graph.workflow import Workflow
from headrace.graph.workflows import common
from headrace.graph.workflows.common import CHUNK_CONFIG, DOCUMENTS, QUESTION

answer = Component("answer", "llm", prompt=(
    "Answer the question in two or three short factual sentences.\n"
    "Question: {{input:question}}\nAnswer: {{output:draft}}"))
# The claims decode is constrained to a JSON list of strings, so each claim parses by construction.
claims = Component("claims", "llm", splittable="json", prompt=(
    "List the factual claims made in the text as a JSON array of strings, one short claim per item.\n"
    "Text: {{input:draft}}\nClaims:\n{{output:claims}}"))
queries = Component("queries", "llm", splittable="lines", batchable=True, prompt=(
    "Write {{input:n_queries}} short web search queries that would check the claim, one per line, with nothing else.\n"
    "Claim: {{input:claims}}\nQueries:\n{{output:queries}}"))
search = Component("search", "text_search", inputs=("queries", "collection"), outputs=("evidence",), batchable=True)
verdict = Component("verdict", "llm", batchable=True, prompt=(
    "Decide whether the evidence supports the claim. Start with SUPPORTED or NOT SUPPORTED, then give one reason.\n"
    "Claim: {{input:claims}}\nEvidence:\n{{input:evidence}}\nVerdict: {{output:verdict}}"))
report = Component("report", "function", inputs=("claims", "verdict"), outputs=("report",), config={
    "fn": lambda cs, vs: [{"claim": c, "verdict": v, "supported": not str(v).upper().startswith("NOT")}
                          for c, v in zip(cs, vs)]})


def build(inputs: dict[str, Any], config: dict[str, Any], engines: Mapping[str, str]):
    b = GraphBuilder("fact_verify", engines)
    common.index(b, inputs, config)
    inputs["n_queries"] = str(config["queries_per_claim"])
    llm = {"max_tokens": config["max_tokens"]}
    b.emit(answer, **llm)
    source = b.emit(claims, max_tokens=24 * config["max_claims"], max_pieces=config["max_claims"])
    b.emit(queries, max_tokens=16 * config["queries_per_claim"], max_pieces=config["queries_per_claim"])
    b.emit(search, k=config["k"])
    b.emit(verdict, **llm)
    b.map(source, queries, search, verdict)  # everything after the claims runs once per claim
    b.emit(report)
    return b.finish(Template([common.chunk, common.embed_chunks, common.ingest, answer, claims, queries, search,
                              verdict, report]))


FACT_VERIFY = Workflow(
    name="fact_verify",
    description="Answer, split the answer into claims, search evidence per claim, and judge each claim.",
    inputs={"question": QUESTION, "documents": {**DOCUMENTS, "description": "the evidence corpus"}},
    required=("question", "documents"),
    config={**CHUNK_CONFIG,
            "max_claims": {"type": "integer", "minimum": 1, "maximum": 8, "default": 3},
            "queries_per_claim": {"type": "integer", "minimum": 1, "maximum": 4, "default": 2},
            "k": {"type": "integer", "minimum": 1, "maximum": 16, "default": 2}},
    build=build,
    outputs=("report", "draft"),
    kinds=("llm", "embed", "vector_store"),
)
