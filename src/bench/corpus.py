"""The benchmark corpus: standard-library docstrings grouped into documents, and questions about them.

Real prose this project did not write, shipped with every Python. A document is
one module's docstring followed by the docstrings of its public functions and
classes, grown with further modules until it holds at least ``min_tokens``
tokens and cut at ``max_tokens``. Each question names a function or class whose
docstring is in its document, so a retriever can find the answer. Everything
is fixed by the seed.
"""

from __future__ import annotations

import importlib
import inspect
import random
from dataclasses import dataclass
from typing import Callable

# Well-documented pure-Python modules present in every CPython build.
MODULES = (
    "json", "csv", "heapq", "statistics", "copy", "subprocess", "argparse", "textwrap", "string", "shutil",
    "functools", "bisect", "fractions", "decimal", "difflib", "pathlib", "queue", "base64", "calendar", "fnmatch",
    "glob", "gzip", "tempfile", "contextlib", "dataclasses", "enum", "pprint", "shlex", "zipfile", "tarfile",
    "logging", "threading", "pickle", "inspect", "ast", "unittest", "doctest", "typing", "configparser", "sched",
    "selectors", "socketserver", "optparse", "weakref", "urllib.parse", "http.client", "email.message", "smtplib",
)
QUESTION_FORMS = (
    "What does {name} do?",
    "How do I use {name}?",
    "What does {name} return?",
    "What arguments does {name} accept?",
    "When should I use {name}?",
)


@dataclass(frozen=True)
class Document:
    title: str
    text: str
    tokens: int
    topics: tuple[str, ...]  # the functions and classes documented in it, as module.name


@dataclass(frozen=True)
class Question:
    text: str
    document: int  # index into Corpus.documents
    topic: str


@dataclass(frozen=True)
class Corpus:
    documents: tuple[Document, ...]
    questions: tuple[Question, ...]

    def to_json(self) -> dict:
        return {"documents": [{"title": d.title, "tokens": d.tokens, "words": len(d.text.split()),
                               "topics": len(d.topics)} for d in self.documents],
                "questions": [{"text": q.text, "document": q.document} for q in self.questions]}


def estimate_tokens(text: str) -> int:
    """About 1.4 tokens per English word for a BPE tokenizer (SmolLM2's gives 1.3-1.5 on docstrings)."""
    return int(len(text.split()) * 1.4)


def _sections(module_name: str) -> list[tuple[str, str]]:
    """(topic, text) for the module and each documented public member, in source order."""
    module = importlib.import_module(module_name)
    out = [(module_name, _clean(inspect.getdoc(module)))]
    for name in getattr(module, "__all__", None) or sorted(vars(module)):
        if name.startswith("_"):
            continue
        obj = getattr(module, name, None)
        if not (inspect.isfunction(obj) or inspect.isclass(obj)) or getattr(obj, "__module__", "") != module_name:
            continue
        doc = _clean(inspect.getdoc(obj))
        if len(doc.split()) >= 12:
            out.append((f"{module_name}.{name}", f"{module_name}.{name}: {doc}"))
    return [(t, s) for t, s in out if s]


def _clean(doc: str | None) -> str:
    return " ".join((doc or "").split())


def build_corpus(seed: int = 0, n_documents: int = 4, n_questions: int = 8, min_tokens: int = 2000,
                 max_tokens: int = 8000, count_tokens: Callable[[str], int] = estimate_tokens) -> Corpus:
    if not 0 < min_tokens <= max_tokens:
        raise ValueError("need 0 < min_tokens <= max_tokens")
    rng = random.Random(seed)
    modules = list(MODULES)
    rng.shuffle(modules)
    documents: list[Document] = []
    while modules and len(documents) < n_documents:
        titles, parts, topics, tokens = [], [], [], 0
        def full() -> bool:  # big enough, and with something to ask about
            return tokens >= min_tokens and any("." in t for t in topics)

        while modules and not full():
            name = modules.pop()
            titles.append(name)
            for topic, text in _sections(name):
                if full() or tokens >= max_tokens:
                    break
                cost = count_tokens(text)
                if tokens + cost > max_tokens:  # cut the last section at the limit
                    words = text.split()
                    text = " ".join(words[: max(1, int(len(words) * (max_tokens - tokens) / cost))])
                    cost = count_tokens(text)
                parts.append(text)
                topics.append(topic)
                tokens += cost
        if not full():
            break  # the modules ran out: a short document would break the size promise
        documents.append(Document(" + ".join(titles), "\n\n".join(parts), tokens,
                                  tuple(t for t in topics if "." in t)))
    if len(documents) < n_documents:
        raise ValueError(f"the standard library yields only {len(documents)} documents of >= {min_tokens} tokens")
    questions = []
    for i in range(n_questions):
        doc = i % len(documents)
        topic = rng.choice(documents[doc].topics)
        questions.append(Question(rng.choice(QUESTION_FORMS).format(name=topic), doc, topic))
    return Corpus(tuple(documents), tuple(questions))
