"""``rag-repeat``'s workload: the collection (the bench corpus grown until the workflows' chunking yields enough
chunks) and the questions drawn on its topics by Zipf popularity, the same in every mode."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable

from headrace.bench.client import BenchError
from headrace.bench.corpus import QUESTION_FORMS, Corpus, build_corpus
from headrace.graph.workflows.common import CHUNK_CONFIG

CHUNK_SIZE = CHUNK_CONFIG["chunk_size"]["default"]  # the workflows' own chunking (256 words, 30 shared)
CHUNK_OVERLAP = CHUNK_CONFIG["chunk_overlap"]["default"]
TOP_SHARE = 0.03  # RAGCache's figure: the share of retrievals the top 3% of chunks drew


def chunk_count(documents: list[str]) -> int:
    from headrace.graph.ops import chunk_text

    return len(chunk_text(documents, CHUNK_SIZE, CHUNK_OVERLAP))


# More documented pure-Python modules, past the bench corpus's own (corpus.MODULES yields about 116 chunks; these ~125 more):
# each one document of its docstrings, added in a seeded order until the collection is big enough.
MORE_MODULES = (
    "asyncio.tasks", "asyncio.streams", "asyncio.locks", "email.utils", "urllib.request", "http.server",
    "xml.dom.minidom", "xml.etree.ElementTree", "imaplib", "ssl", "socket", "codecs", "locale", "plistlib", "uuid",
    "ipaddress", "platform", "traceback", "tokenize", "dis", "filecmp", "abc", "warnings", "collections", "os",
    "mimetypes", "wsgiref.simple_server", "xmlrpc.client", "codeop", "lzma", "http.cookiejar", "email.headerregistry",
    "logging.handlers", "unittest.mock", "shelve", "unittest.case", "xml.sax.handler", "xml.sax.saxutils",
)


def corpus_for(min_chunks: int, seed: int, doc_tokens: int, count_tokens: Callable[[str], int]) -> Corpus:
    """The bench corpus with documents added until the collection's chunking yields ``min_chunks``: its own
    documents first (as many as ``build_corpus`` makes), then one per module of ``MORE_MODULES``."""
    from headrace.bench.corpus import Document, _sections

    n, corpus = 1, None
    while True:
        try:
            corpus = build_corpus(seed, n_documents=n, min_tokens=doc_tokens, count_tokens=count_tokens)
        except ValueError:  # the bench corpus's modules ran out: one more than the last that worked, else done
            if corpus is None or n == len(corpus.documents) + 1:
                break
            n = len(corpus.documents) + 1
            continue
        chunks = chunk_count([d.text for d in corpus.documents])
        if chunks >= min_chunks:
            return corpus
        n = max(n + 1, math.ceil(n * min_chunks / max(1, chunks)))  # about enough, in few tries
    if corpus is None:
        raise BenchError(f"no bench corpus document of {doc_tokens} tokens: lower --doc-tokens")
    documents = list(corpus.documents)
    more = list(MORE_MODULES)
    random.Random(seed).shuffle(more)
    for module in more:
        try:
            sections = _sections(module)
        except ImportError:  # not in this Python
            continue
        text = "\n\n".join(body for _, body in sections)
        documents.append(Document(module, text, count_tokens(text), tuple(t for t, _ in sections if "." in t)))
        if chunk_count([d.text for d in documents]) >= min_chunks:
            return Corpus(tuple(documents), corpus.questions)
    raise BenchError(f"the corpus yields only {chunk_count([d.text for d in documents])} chunks: lower --rag-chunks")


@dataclass(frozen=True)
class Query:
    index: int
    topic: str
    text: str


def topics_of(corpus: Corpus) -> list[str]:
    return list(dict.fromkeys(t for d in corpus.documents for t in d.topics))


def draw_queries(corpus: Corpus, n: int, zipf: float, seed: int, salt: int) -> list[Query]:
    """``n`` questions: a topic by Zipf popularity over a shuffle of the topics fixed by ``seed`` (the same
    popular topics in every draw), a question form at random; ``salt`` tells draws of one run apart."""
    ranked = topics_of(corpus)
    random.Random(seed).shuffle(ranked)
    weights = [(r + 1) ** -zipf for r in range(len(ranked))]
    rng = random.Random(f"{seed}:{salt}")
    out = []
    for i in range(n):
        topic = rng.choices(ranked, weights)[0]
        out.append(Query(i, topic, rng.choice(QUESTION_FORMS).format(name=topic)))
    return out
