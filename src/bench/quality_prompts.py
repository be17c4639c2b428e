"""The quality benchmark's workflow prompts: RAG synthesis over the bench corpus, as ``naive_rag`` renders them.

``headrace.quality.prompts`` holds the chat prompts; this adds what needs the layers above it (the bench corpus,
the workflows' templates and their chat frame), so the set is built here and scored there:

- ``rag``: ``naive_rag``'s tree synthesis leaf (its default): the ``answer`` template over one retrieved chunk
  (the workflows' chunking, 256 words), a question from the corpus about a function or class documented in it;
- ``long`` (~1,000 tokens): ``naive_rag`` with ``synthesis = "one_shot"`` over three chunks, and a user asking for a
  summary of ~700 words of a corpus document.

Every text is framed as the workflow frames it (``headrace.graph.prompts.chat_frame``: the engine's chat template
around the rendered template) and tokenized as it does (no special tokens added).
"""

from __future__ import annotations

import random
from typing import Any

from headrace.bench.corpus import build_corpus
from headrace.graph.ops import chunk_text
from headrace.graph.prompts import PromptTemplate, chat_frame
from headrace.graph.workflows.common import ANSWER, CHUNK_CONFIG, ONE_SHOT
from headrace.plugins.engines.llm.chat import apply_template
from headrace.quality.prompts import ChatSource, PromptSet, TextSource, build_prompt_set

CHUNK_WORDS = CHUNK_CONFIG["chunk_size"]["default"]
CHUNK_OVERLAP = CHUNK_CONFIG["chunk_overlap"]["default"]
RAG_PROMPTS, ONE_SHOT_PROMPTS, SUMMARY_PROMPTS = 50, 30, 10
SUMMARY_WORDS = 700
CORPUS_DOCUMENTS, CORPUS_TOKENS = 8, 2000


class _Frame:
    """What ``chat_frame`` asks of an engine, from a tokenizer alone."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def chat_prompt(self, messages: Any) -> str:
        return apply_template(self.tokenizer, messages, None, tokenize=False)


def workflow_sources(tokenizer: Any, seed: int = 0) -> list[ChatSource | TextSource]:
    """The RAG and long prompts, fixed by ``seed`` and the Python's standard library (the corpus's prose)."""
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    corpus = build_corpus(seed, n_documents=CORPUS_DOCUMENTS, n_questions=RAG_PROMPTS + ONE_SHOT_PROMPTS,
                          min_tokens=CORPUS_TOKENS, count_tokens=count)
    chunks = [chunk_text(d.text, CHUNK_WORDS, CHUNK_OVERLAP) for d in corpus.documents]
    head, tail = chat_frame(_Frame(tokenizer), None)
    rng = random.Random(seed)

    def framed(template: str, values: dict[str, Any]) -> TextSource:
        text = PromptTemplate(template).render(values)
        prefix = PromptTemplate(template).split(set())[0]  # the static text before the first input
        return TextSource("", head + text + tail, head + prefix)

    def topic_chunk(q) -> str:
        name = q.topic.rsplit(".", 1)[-1]
        doc = chunks[q.document]
        return next((c for c in doc if q.topic in c), next((c for c in doc if name in c), doc[0]))

    out: list[ChatSource | TextSource] = []
    for q in corpus.questions[:RAG_PROMPTS]:
        s = framed(ANSWER, {"question": q.text, "context": topic_chunk(q)})
        out.append(TextSource("rag", s.text, s.prefix))
    every = [c for doc in chunks for c in doc]
    for q in corpus.questions[RAG_PROMPTS:]:
        first = topic_chunk(q)
        others = rng.sample([c for c in every if c != first], 2)  # what else a search returned
        s = framed(ONE_SHOT, {"question": q.text, "contexts": [first, *others]})
        out.append(TextSource("long", s.text, s.prefix))
    for i in range(SUMMARY_PROMPTS):
        words = corpus.documents[i % len(corpus.documents)].text.split()
        start = (i // len(corpus.documents)) * SUMMARY_WORDS
        text = " ".join(words[start : start + SUMMARY_WORDS])
        out.append(ChatSource("long", ({"role": "user", "content": f"Summarize this document.\n\n{text}"},)))
    return out


PROMPT_SETS = ("main", "held-out")
HELD_OUT_SEED = 1000  # the held-out set's corpus: other documents and questions than any main set's seed makes


def quality_prompt_set(tokenizer: Any, seed: int = 0, name: str = "main") -> PromptSet:
    """``main``, the whole fixed set (252 prompts): the chat prompts, then the workflow prompts. ``held-out``
    (``headrace.quality.held_out``): 50 other chat prompts and the workflow prompts of another corpus."""
    if name == "held-out":
        from headrace.quality.held_out import held_out_sources
        return build_prompt_set(tokenizer, workflow_sources(tokenizer, HELD_OUT_SEED + seed), held_out_sources())
    if name != "main":
        raise ValueError(f"--quality-set: {name!r} is none of {', '.join(PROMPT_SETS)}")
    return build_prompt_set(tokenizer, workflow_sources(tokenizer, seed))


__all__ = ["PROMPT_SETS", "workflow_sources", "quality_prompt_set"]
