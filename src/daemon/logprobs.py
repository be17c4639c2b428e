"""Log-probabilities in OpenAI's response shapes: chat's ``logprobs.content`` and completions' parallel lists.

Engines report token ids (``TokenLogprob``); clients read token strings. A token's string is
what vLLM shows: the tokenizer's token converted to text on its own (a byte-level piece of a
multi-byte character reads as U+FFFD), with its UTF-8 bytes alongside in chat.
"""

from __future__ import annotations

from typing import Any, Sequence

from headrace.plugins.protocols import TokenLogprob


class TokenStrings:
    """Token ids as strings, with one engine's tokenizer (cached: a response repeats its tokens)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            # An id past the tokenizer's own table (a GGUF vocabulary padded wider): decode says what it can.
            text = (self.tokenizer.convert_tokens_to_string([piece]) if piece is not None
                    else self.tokenizer.decode([token_id]))
            self._cache[token_id] = text
        return text


def _entry(strings: TokenStrings, token_id: int, logprob: float) -> dict[str, Any]:
    token = strings(token_id)
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", errors="replace"))}


def chat_content(items: Sequence[TokenLogprob], strings: TokenStrings) -> list[dict[str, Any]]:
    """``choices[i].logprobs.content`` entries for these tokens."""
    return [{**_entry(strings, lp.token_id, lp.logprob),
             "top_logprobs": [_entry(strings, t, v) for t, v in lp.top]} for lp in items]


class CompletionLogprobs:
    """One choice's ``logprobs`` in /v1/completions, a delta at a time (``text_offset`` runs on across deltas)."""

    def __init__(self, strings: TokenStrings) -> None:
        self.strings = strings
        self.offset = 0

    def add(self, items: Sequence[TokenLogprob]) -> dict[str, Any]:
        tokens, offsets, top = [], [], []
        for lp in items:
            token = self.strings(lp.token_id)
            tokens.append(token)
            offsets.append(self.offset)
            self.offset += len(token)
            # The k most likely, and the sampled token whatever its rank (OpenAI: "up to logprobs + 1").
            alternatives = {self.strings(t): v for t, v in lp.top}
            alternatives.setdefault(token, lp.logprob)
            top.append(alternatives)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in items], "top_logprobs": top,
                "text_offset": offsets}

