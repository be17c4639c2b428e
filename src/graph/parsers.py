"""Streaming parsers for splittable decodes: text in, complete pieces out.

A small model's output is imperfect, so both parsers are forgiving: list
markers and numbering are stripped, and a JSON list that never closes still
yields the items that did.
"""

from __future__ import annotations

import json
import re

ITEM_MARKER = re.compile(r"^\s*(?:[-*•]|\d+[.)]|\(\d+\)|[A-Za-z][.)])\s+")


def clean_item(text: str) -> str:
    return ITEM_MARKER.sub("", text).strip().strip('"').strip()


class LineParser:
    """One piece per non-empty line."""

    def __init__(self) -> None:
        self._buffer = ""

    def feed(self, text: str) -> list[str]:
        self._buffer += text
        *lines, self._buffer = self._buffer.split("\n")
        return [item for item in map(clean_item, lines) if item]

    def finish(self) -> list[str]:
        rest, self._buffer = clean_item(self._buffer), ""
        return [rest] if rest else []


class JsonListParser:
    """One piece per string item of a JSON array, as soon as the item is complete."""

    STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')

    def __init__(self) -> None:
        self._text = ""
        self._pos = -1  # index just past the last emitted item; -1 before '['

    def feed(self, text: str) -> list[str]:
        self._text += text
        if self._pos < 0:
            start = self._text.find("[")
            if start < 0:
                return []
            self._pos = start + 1
        out = []
        while True:
            m = self.STRING.search(self._text, self._pos)
            if m is None or "]" in self._text[self._pos : m.start()]:
                return out
            self._pos = m.end()
            try:
                item = json.loads(m.group(0))
            except json.JSONDecodeError:
                item = m.group(1)
            if item.strip():
                out.append(item.strip())

    def finish(self) -> list[str]:
        if self._pos < 0:  # never saw a list: fall back to lines
            parser = LineParser()
            return parser.feed(self._text) + parser.finish()
        return []


def make_parser(kind: str) -> LineParser | JsonListParser:
    if kind == "lines":
        return LineParser()
    if kind == "json":
        return JsonListParser()
    raise ValueError(f"unknown splittable format {kind!r}; use 'lines' or 'json'")
