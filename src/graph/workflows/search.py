"""search_gen and contextual_retrieval (Ayo §2.1, Figure 2a and 2e).

- search_gen: search-engine-augmented generation. A proxy LLM drafts an answer,
  a judge LLM decides from the question and the draft whether a search is
  needed, and a condition takes the "search" branch (a full-text search of the
  question over the run's corpus) or the "direct" one; the core LLM answers
  with the draft and whatever evidence was found. The corpus is indexed in
  parallel with the proxy and the judge; a persistent ``collection`` is searched
  instead, with nothing indexed in the run.
- contextual_retrieval: Anthropic's contextual retrieval. Each chunk gets a
  one-sentence context written by the LLM from the chunk and its neighbours
  (one call per chunk: they batch); context and chunk are embedded and
  ingested together; the question's nearest ``rerank_from`` chunks are
  reranked to ``top_n``, and one LLM call answers from them.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from headrace.graph import collection_refs
from headrace.graph.components import Component, GraphBuilder, Template
from headrace.graph.workflow import Workflow
from headrace.graph.workflows import common
from headrace.graph.workflows.common import COLLECTION, DOCUMENTS, QUESTION, SHORT_ANSWER_MAX_TOKENS, max_tokens_option

MAX_TOKENS = max_tokens_option(SHORT_ANSWER_MAX_TOKENS)


# search_gen ---------------------------------------------------------------------------

SEARCH_MODES = ("auto", "always", "never")  # auto: the judge decides
JUDGE_TOKENS = 4  # "yes" or "no", with room for a stray token or two

PROXY = "Answer the question in one sentence.\nQuestion: {{input:question}}\nAnswer: {{output:draft}}"
JUDGE = ("Decide whether a web search is needed to answer the question correctly. Reply with yes or no.\n"
         "Question: {{input:question}}\nDraft answer: {{input:draft}}\nSearch needed (yes or no): {{output:judgement}}")
CORE = ("Answer the question. Use the search results when they help.\nQuestion: {{input:question}}\n"
        "Draft answer: {{input:draft}}\nSearch results:\n{{input:evidence}}\nAnswer: {{output:answer}}")

_YES_NO = re.compile(r"\b(yes|no)\b")


def parse_judgement(text: Any) -> str:
    """The branch a judge's reply picks: "search" when its first yes/no word is yes, else "direct"."""
    m = _YES_NO.search(str(text or "").lower())
    return "search" if m is not None and m.group(1) == "yes" else "direct"


def decide(judgement: Any, mode: str) -> str:
    """The branch label: forced by ``config.search`` ("always"/"never"), or read from the judge's reply."""
    if mode == "always":
        return "search"
    if mode == "never":
        return "direct"
    return parse_judgement(judgement)


corpus_chunk = Component("chunk", "chunk", inputs=("corpus",), outputs=("passages",))
embed_passages = Component("embed_passages", "embed", inputs=("passages",), outputs=("passage_vectors",),
                           batchable=True)
ingest_passages = Component("ingest", "ingest", inputs=("passage_vectors", "passages"), outputs=("collection",),
                            batchable=True)
proxy = Component("proxy", "llm", prompt=PROXY)
judge = Component("judge", "llm", prompt=JUDGE)
decide_ = Component("decide", "function", inputs=("judgement", "search_mode"), outputs=("decision",),
                    config={"fn": decide})
route = Component("route", "condition", inputs=("decision",), outputs=("branch",),
                  config={"predicate": str})
# Reads the condition's output so it is dispatched only once the branch is known (a data
# edge: dependency pruning drops order-only ones); skipped, it yields no evidence.
text_search = Component("search", "text_search", inputs=("question", "collection"), outputs=("evidence",),
                        batchable=True, config={"reads": ("branch",), "default": ""})
core = Component("answer", "llm", prompt=CORE)


def build_search_gen(inputs: dict[str, Any], config: dict[str, Any], engines: Mapping[str, str]):
    b = GraphBuilder("search_gen", engines)
    inputs["search_mode"] = config["search"]  # read by the decide function
    indexing = []
    if collection_refs.source(inputs, "corpus") == "corpus":
        n = common.count_chunks(inputs, "corpus", config)
        b.emit(corpus_chunk, size=n, words=config["chunk_size"], overlap=config["chunk_overlap"])
        b.emit(embed_passages, size=n)
        b.emit(ingest_passages, size=n)
        indexing = [corpus_chunk, embed_passages, ingest_passages]
    else:  # a persistent collection: its table already has the full-text index; nothing to index here
        inputs["collection"] = collection_refs.table_name(inputs["collection"])
    b.emit(proxy, max_tokens=config["max_tokens"])
    b.emit(judge, max_tokens=JUDGE_TOKENS)
    b.emit(decide_)
    condition = b.emit(route)
    searched = b.emit(text_search, k=config["k"])
    b.branch(condition, "search", searched)
    b.emit(core, max_tokens=config["max_tokens"])
    return b.finish(Template([*indexing, proxy, judge, decide_, route, text_search, core]))


SEARCH_GEN = Workflow(
    name="search_gen",
    description="Search-engine-augmented generation: a proxy LLM drafts an answer, a judge LLM decides whether "
                "to search, a full-text search over the corpus runs only if so, and the core LLM answers.",
    inputs={"question": QUESTION,
            "corpus": {**DOCUMENTS, "description": "documents to index for full-text search"},
            "collection": COLLECTION},
    required=("question",),  # and one of corpus / collection
    config={
        "chunk_size": {"type": "integer", "minimum": 16, "maximum": 1024, "default": 128,
                       "description": "words per indexed passage"},
        "chunk_overlap": {"type": "integer", "minimum": 0, "maximum": 1023, "default": 0},
        "max_tokens": MAX_TOKENS,
        "k": {"type": "integer", "minimum": 1, "maximum": 16, "default": 3, "description": "search results"},
        "search": {"type": "string", "enum": list(SEARCH_MODES), "default": "auto",
                   "description": "auto: the judge decides; always / never: force the branch"},
    },
    build=build_search_gen,
    kinds=("llm", "embed", "vector_store"),
)


# contextual_retrieval -----------------------------------------------------------------

CONTEXT = ("Write one short sentence that says what the middle chunk is about within the whole document.\n"
           "Previous chunk: {{input:before}}\nMiddle chunk: {{input:chunk}}\nNext chunk: {{input:after}}\n"
           "Context: {{output:context}}")
NO_NEIGHBOUR = "(none)"


def join_contexts(chunks: list[str], *contexts: str) -> list[str]:
    """Each chunk with its context sentence in front (the chunk alone when the context is empty)."""
    return [f"{str(ctx).strip()}\n{text}" if str(ctx).strip() else text
            for text, ctx in zip(chunks, contexts, strict=True)]


def spread_chunks(n: int) -> Component:
    """The chunks, one variable each, plus ``chunk_none`` for the missing neighbours at the ends."""
    return Component("spread", "function", inputs=("chunks",),
                     outputs=("chunk_none", *(f"chunk_{i}" for i in range(n))),
                     config={"fn": lambda items: (NO_NEIGHBOUR, *(list(items) + [""] * n)[:n])})


context = Component("context", "llm", prompt=CONTEXT)
embed_contextual = Component("embed_contextual", "embed", inputs=("contextual_chunks",),
                             outputs=("contextual_vectors",), batchable=True)
ingest_contextual = Component("ingest", "ingest", inputs=("contextual_vectors", "contextual_chunks"),
                              outputs=("collection",), batchable=True)
embed_question = Component("embed_question", "embed", inputs=("question",), outputs=("question_vector",),
                           batchable=True)
search = Component("search", "search", inputs=("question_vector", "collection"), outputs=("candidates",),
                   batchable=True)
rerank = Component("rerank", "rerank", inputs=("question", "candidates"), outputs=("top",), batchable=True)


def build_contextual(inputs: dict[str, Any], config: dict[str, Any], engines: Mapping[str, str]):
    b = GraphBuilder("contextual_retrieval", engines)
    n = common.count_chunks(inputs, "documents", config)
    b.emit(common.chunk, size=n, words=config["chunk_size"], overlap=config["chunk_overlap"])
    spread = spread_chunks(n)
    b.emit(spread)
    contexts = [f"context_{i}" for i in range(n)]
    for i in range(n):
        before = f"chunk_{i - 1}" if i > 0 else "chunk_none"
        after = f"chunk_{i + 1}" if i < n - 1 else "chunk_none"
        b.emit(context, suffix=f"_{i}", rename={"before": before, "chunk": f"chunk_{i}", "after": after,
                                                "context": contexts[i]}, max_tokens=config["context_tokens"])
    join = Component("contextualize", "function", inputs=("chunks", *contexts), outputs=("contextual_chunks",),
                     config={"fn": join_contexts})
    b.emit(join)
    b.emit(embed_contextual, size=n)
    b.emit(ingest_contextual, size=n)
    b.emit(embed_question)
    b.emit(search, k=config["rerank_from"])
    top_n = min(config["top_n"], config["rerank_from"])
    b.emit(rerank, top_n=top_n, size=min(n, config["rerank_from"]))
    synth = common.synthesize(b, "one_shot", "top", top_n, config)
    return b.finish(Template([common.chunk, spread, context, join, embed_contextual, ingest_contextual,
                              embed_question, search, rerank, *synth]))


CONTEXTUAL = Workflow(
    name="contextual_retrieval",
    description="Contextual retrieval: the LLM writes a one-sentence context for each chunk from its neighbours; "
                "contextualized chunks are embedded and indexed; retrieve, rerank, answer in one shot.",
    inputs={"question": QUESTION, "documents": DOCUMENTS},
    required=("question", "documents"),
    config={
        "chunk_size": {"type": "integer", "minimum": 16, "maximum": 1024, "default": 128,
                       "description": "words per chunk"},
        "chunk_overlap": {"type": "integer", "minimum": 0, "maximum": 1023, "default": 0},
        "max_tokens": MAX_TOKENS,
        "context_tokens": {"type": "integer", "minimum": 1, "maximum": 256, "default": 32,
                           "description": "tokens per chunk's context sentence"},
        "rerank_from": {"type": "integer", "minimum": 1, "maximum": 128, "default": 32,
                        "description": "chunks retrieved for the reranker"},
        "top_n": {"type": "integer", "minimum": 1, "maximum": 16, "default": 3,
                  "description": "chunks kept after reranking"},
    },
    build=build_contextual,
    kinds=("llm", "embed", "vector_store", "rerank"),
)
