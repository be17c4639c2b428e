"""Text checks shared by every layer: what a tokenizer, a store or a JSON encoder can take."""

from __future__ import annotations

from typing import Iterable


def is_unicode(text: str) -> bool:
    """False for a string holding a lone UTF-16 surrogate (JSON's ``"\\ud800"`` decodes to one):
    no tokenizer, store or UTF-8 encoder takes it, and in a batch it fails every item."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_texts(texts: Iterable[object], what: str) -> None:
    """Raise ValueError naming the first item that is not a string of valid Unicode."""
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"{what} {i} is a {type(text).__name__}, not a string")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"{what} {i} is not valid Unicode text: {exc.reason} at character {exc.start}") from None
