"""Log-probabilities in OpenAI's response shapes: chat's ``logprobs.content`` and completions' parallel lists,
and vLLM's ``prompt_logprobs``.

Engines report token ids (``TokenLogprob``); clients read token strings. A token's string is
what vLLM shows: the tokenizer's token converted to text on its own (a byte-level piece of a
multi-byte character reads as U+FFFD), with its UTF-8 bytes alongside in chat. An echoed prompt's
tokens go through the same formatting as generated ones, so the two read alike.
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
        return self._entries([(lp.token_id, lp) for lp in items])

    def add_prompt(self, tokens: Sequence[int], scores: Sequence[TokenLogprob | None], k: int) -> dict[str, Any]:
        """An echoed prompt's entries: ``scores[i]`` scores ``tokens[i]`` (None: nothing precedes it, so its
        logprob and top_logprobs are null, as OpenAI and vLLM give the first); ``k`` of each score's alternatives."""
        return self._entries([(t, None if lp is None else TokenLogprob(lp.token_id, lp.logprob, lp.top[:k]))
                              for t, lp in zip(tokens, scores)])

    def _entries(self, items: Sequence[tuple[int, TokenLogprob | None]]) -> dict[str, Any]:
        tokens, offsets, top = [], [], []
        for token_id, lp in items:
            token = self.strings(token_id)
            tokens.append(token)
            offsets.append(self.offset)
            self.offset += len(token)
            if lp is None:
                top.append(None)
                continue
            # The k most likely, and the sampled token whatever its rank (OpenAI: "up to logprobs + 1").
            alternatives = {self.strings(t): v for t, v in lp.top}
            alternatives.setdefault(token, lp.logprob)
            top.append(alternatives)
        return {"tokens": tokens, "token_logprobs": [None if lp is None else lp.logprob for _, lp in items],
                "top_logprobs": top, "text_offset": offsets}


def joined(*parts: dict[str, Any]) -> dict[str, Any]:
    """Completions' parallel lists of consecutive parts (an echoed prompt's, then the output's) as one."""
    return {key: [x for part in parts for x in part[key]] for key in parts[0]}


def prompt_logprobs(tokens: Sequence[int], scores: Sequence[TokenLogprob | None], ranks: Sequence[int | None],
                    k: int, strings: TokenStrings) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, null where nothing precedes it, else by token id (a string)
    the actual token (its ``ranks[i]``) then the ``k`` most likely there (ranked 1 to k)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for token_id, lp, rank in zip(tokens, scores, ranks):
        if lp is None:
            out.append(None)
            continue
        entry = {str(token_id): {"logprob": lp.logprob, "rank": rank, "decoded_token": strings(token_id)}}
        for i, (t, v) in enumerate(lp.top[:k]):
            entry.setdefault(str(t), {"logprob": v, "rank": i + 1, "decoded_token": strings(t)})
        out.append(entry)
    return out

