"""Prompt templates with Parrot's semantic-variable placeholders.

``{{input:name}}`` is filled from the variable ``name``; ``{{output:name}}``
marks where the model's answer goes, and names the variable it becomes. The
placeholders make a prompt's data dependencies explicit, and the text before
the first input that is not yet available is a prefix that can be prefilled
early (Parrot §5.3, Ayo's prefill split).

A prompt node's text is framed by the engine's chat template and tokenized
here, for the prefill handlers.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Mapping

from headrace.graph.graph import Node

PLACEHOLDER = re.compile(r"\{\{(input|output):([A-Za-z_][A-Za-z0-9_]*)\}\}")


def _text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "\n\n".join(_text(v) for v in value)
    return str(value)


@dataclass(frozen=True)
class PromptTemplate:
    text: str

    def __post_init__(self) -> None:
        outputs = [m for m in PLACEHOLDER.finditer(self.text) if m.group(1) == "output"]
        if len(outputs) > 1:
            raise ValueError("a prompt has at most one {{output:...}} placeholder")
        if outputs and self.text[outputs[0].end():].strip():
            raise ValueError("{{output:...}} must end the prompt: the answer is generated after it")

    @property
    def inputs(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for m in PLACEHOLDER.finditer(self.text):
            if m.group(1) == "input":
                seen.setdefault(m.group(2))
        return tuple(seen)

    @property
    def output(self) -> str | None:
        for m in PLACEHOLDER.finditer(self.text):
            if m.group(1) == "output":
                return m.group(2)
        return None

    def render(self, values: Mapping[str, Any]) -> str:
        """The prompt text up to the output placeholder, every input filled in."""

        def fill(m: re.Match) -> str:
            if m.group(1) == "output":
                return ""
            if m.group(2) not in values:
                raise KeyError(f"prompt input {m.group(2)!r} has no value")
            return _text(values[m.group(2)])

        return PLACEHOLDER.sub(fill, self.text).rstrip(" ")

    def split(self, available: set[str]) -> tuple[str, str]:
        """(prefix, rest): the prefix holds only inputs in ``available``, and ends where the first missing one starts."""
        for m in PLACEHOLDER.finditer(self.text):
            if m.group(1) == "output" or m.group(2) not in available:
                return self.text[: m.start()], self.text[m.start():]
        return self.text, ""

    def prefix_hash(self) -> str:
        """Hash of the static text before the first placeholder (Parrot's PrefixHash)."""
        m = PLACEHOLDER.search(self.text)
        static = self.text[: m.start()] if m else self.text
        return hashlib.sha1(static.encode()).hexdigest()[:12]


# Stands in for the user's message in the chat template, so the text around it can be cut out.
SENTINEL = "\x00HEADRACE\x00"


def chat_frame(engine: Any, system: str | None) -> tuple[str, str]:
    """The chat template's text before and after the user's message."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": SENTINEL}]
    head, _, tail = engine.chat_prompt(messages).partition(SENTINEL)
    return head, tail


def _prompt_text(engine: Any, node: Node, scope: Mapping[str, Any], part: str) -> str:
    head, tail = chat_frame(engine, node.params.get("system"))
    prompt = node.params["prompt"]
    if part == "whole":  # the split-off prefix and the rest, as one prompt
        prompt, part = node.params["split_prefix"] + prompt, "all"
    text = PromptTemplate(prompt).render(scope)
    if part == "prefix":
        return head + text
    if part == "rest":
        return text + tail
    return head + text + tail


def prompt_tokens(engine: Any, node: Node, scope: Mapping[str, Any], part: str) -> list[int]:
    """Tokens of a prompt, or of its split-off prefix or rest (see the prefill-split pass)."""
    return engine.encode(_prompt_text(engine, node, scope, part))


# Stands in for document i while the prompt is rendered, so the text around the documents can be cut out.
DOCUMENT_MARK = re.compile("\x00HEADRACE-DOCUMENT-([0-9]+)\x00")


def document_marks(texts: list[Any]) -> list[str]:
    """What stands in for each document while the prompt is rendered (an empty text stays empty: no document)."""
    return [f"\x00HEADRACE-DOCUMENT-{i}\x00" if str(text) else "" for i, text in enumerate(texts)]


def tokenize_documents(engine: Any, marked: str, texts: list[Any]) -> tuple[list[int], list[tuple[int, int]]]:
    """``marked`` (a prompt rendered with ``document_marks``) tokenized with each document alone, where it stands,
    as its KV was computed (``PlacesDocuments``), the text between them in pieces: the tokens, and each document's
    (start, length) in them. The tokens may differ from the whole text's at the documents' edges."""
    tokens: list[int] = []
    spans: list[tuple[int, int]] = []
    for i, piece in enumerate(DOCUMENT_MARK.split(marked)):
        if i % 2:  # a document's index
            doc = list(engine.encode(str(texts[int(piece)])))
            spans.append((len(tokens), len(doc)))
            tokens += doc
        elif piece:
            tokens += engine.encode(piece)
    return tokens, [s for s in spans if s[1]]


def prompt_documents(engine: Any, node: Node, scope: Mapping[str, Any],
                     part: str) -> tuple[list[int], list[tuple[int, int]]]:
    """A prompt whose retrieved documents (the variable ``node.params["placed_documents"]`` names: a text or a list
    of texts) are tokenized alone (``tokenize_documents``): the tokens and the documents' spans."""
    name = node.params["placed_documents"]
    value = scope.get(name)
    texts = [value] if isinstance(value, str) else list(value or ())
    marks = document_marks(texts)
    marked = {**scope, name: marks[0] if isinstance(value, str) else marks}
    return tokenize_documents(engine, _prompt_text(engine, node, marked, part), texts)
