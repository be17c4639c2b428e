"""A task score for retrieval prompts: extractive questions over real prose, scored as SQuAD scores answers.

Teacher-forced KL says how far an engine's numbers are from a reference on the same prompt; it cannot compare two
prompts that say the same thing in another order (the question before or after the documents), nor say what a
drift costs in answers. This does: questions whose gold answer is a span of a document, an answer scored by exact
match and token F1 against it after SQuAD's normalization (lower case, no punctuation, no articles, whitespace
collapsed; the official script's rules).

The questions come from the standard library's own docstrings (the bench corpus's prose, real text this project did
not write): a function whose docstring opens "Return(s) X." asks "What does module.name return?" with X as the gold
span. Everything is fixed by the Python that runs it.
"""

from __future__ import annotations

import collections
import re
import string
from dataclasses import dataclass
from typing import Iterable, Sequence

_OPENING = re.compile(r"^Returns? (?P<span>[^.]{12,160}?)\.(\s|$)")
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation)


@dataclass(frozen=True)
class QAItem:
    question: str
    gold: str  # a span of ``section``
    topic: str  # module.name
    section: str  # the docstring's text as the corpus writes it: "module.name: doc"


def normalize(text: str) -> str:
    """SQuAD's answer normalization: lower case, punctuation and articles removed, whitespace collapsed."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize(prediction) == normalize(gold))


def token_f1(prediction: str, gold: str) -> float:
    """Harmonic mean of token precision and recall after ``normalize`` (a bag of tokens, counted)."""
    pred, ref = normalize(prediction).split(), normalize(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((collections.Counter(pred) & collections.Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def answer_text(generated: str) -> str:
    """What is scored of a generated answer: its first non-empty line (a model that goes on after answering
    is not marked down for the rest), stripped."""
    for line in generated.splitlines():
        if line.strip():
            return line.strip()
    return ""


def returns_items(sections: Iterable[tuple[str, str]]) -> list[QAItem]:
    """One question per (topic, section) whose docstring opens "Return(s) X.": "What does topic return?", X."""
    out = []
    for topic, section in sections:
        if "." not in topic:  # a module's own docstring: no function to ask about
            continue
        doc = section.split(": ", 1)[1] if section.startswith(f"{topic}: ") else section
        m = _OPENING.match(doc)
        if m is None:
            continue
        span = m.group("span").strip()
        if len(span.split()) < 3:
            continue
        out.append(QAItem(f"What does {topic} return?", span, topic, section))
    return out


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


__all__ = ["QAItem", "normalize", "exact_match", "token_f1", "answer_text", "returns_items", "mean"]
