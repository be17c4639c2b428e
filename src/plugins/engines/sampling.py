"""Token sampling and incremental detokenisation, shared by the cores of in-process LLM engines."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from headrace.plugins.protocols import SamplingParams, TokenLogprob


# Below this temperature a row decodes greedily, as vLLM does: dividing logits by a
# smaller one overflows float32 to inf, and softmax of inf is NaN.
GREEDY_TEMPERATURE = 1e-5
# What a log-probability of -inf (or NaN) is reported as: JSON has no infinities; OpenAI and vLLM use this floor.
LOGPROB_FLOOR = -9999.0


def make_generator(seed: int | None) -> torch.Generator:
    """A row's RNG. ``SamplingParams`` admits only seeds that ``manual_seed`` takes."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_TEMPERATURE


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` with every token whose bit is 0 in its row of ``bitmask`` (B, ceil(V/32) int32) set to -inf.

    Unpacked with numpy's ``unpackbits`` (tens of microseconds at B x 49k): llguidance's own
    helper is a ``torch.compile`` kernel, which needs a C++ toolchain at run time on a CPU.
    Token t is bit t % 32 of word t // 32, as llguidance writes it.
    """
    rows, width = logits.shape
    words = bitmask.contiguous().numpy().astype("<i4", copy=False)  # little-endian: byte order = token order
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")[:, :width]
    allowed = torch.from_numpy(bits).bool()
    if allowed.shape[1] < width:  # ids past the mask are not in the tokenizer: never allowed
        allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]), value=False)
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator],
           bitmask: torch.Tensor | None = None) -> list[int]:
    """One token per row of ``logits`` (B, V), each row with its own params and RNG.

    Every value ``SamplingParams`` admits works: tiny temperatures are greedy, a
    top_p that rounds to 0 keeps the top token, and a row whose distribution is
    not finite (NaN logits) falls back to its argmax rather than failing.
    ``bitmask`` (rows of a constrained decode's allowed tokens, see ``apply_bitmask``)
    is applied first, so greedy and sampled rows alike pick only allowed tokens.
    """
    if bitmask is not None:
        logits = apply_bitmask(logits, bitmask)
    greedy = logits.argmax(dim=-1).tolist()
    sampled_rows = [i for i, p in enumerate(params) if not is_greedy(p)]
    if not sampled_rows:
        return greedy
    rows = torch.tensor(sampled_rows)
    temps = torch.tensor([params[i].temperature for i in sampled_rows], dtype=torch.float32).unsqueeze(1)
    probs = torch.softmax(logits[rows].float() / temps, dim=-1)
    top_ps = torch.tensor([params[i].top_p for i in sampled_rows], dtype=torch.float32).unsqueeze(1)
    if bool((top_ps < 1).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p, and always the top token
        # (a top_p of 1e-300 is 0 in float32, which would otherwise drop every token).
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_ps
        drop[:, 0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    usable = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)
    for j, i in enumerate(sampled_rows):
        if bool(usable[j]):
            greedy[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]).item())
    return greedy


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s log-probability in one row of ``logits`` (V,), with the ``top`` most likely tokens.

    Of the raw distribution (log_softmax of the logits, before temperature and top_p), as
    vLLM reports by default and OpenAI documents.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    logprobs = torch.nan_to_num(logprobs, nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR).clamp_(min=LOGPROB_FLOOR)
    alternatives: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = torch.topk(logprobs, min(top, logprobs.numel()))
        alternatives = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(logprobs[token]), alternatives)


@dataclass
class Detokenizer:
    """Turns a growing list of token ids into text deltas, and applies stop strings.

    Decodes a short window of recent tokens so each step costs O(1), and holds
    back text that is an incomplete UTF-8 sequence or could still become a stop
    string.
    """

    tokenizer: object
    stop: tuple[str, ...] = ()
    ids: list[int] = field(default_factory=list)
    text: str = ""  # everything decoded so far
    emitted: int = 0  # chars of ``text`` already handed out
    _prefix_offset: int = 0
    _read_offset: int = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)  # type: ignore[attr-defined]

    def add(self, token_id: int) -> tuple[str, bool]:
        """Append a token; return (new text to emit, whether a stop string ended it)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
        return self._take()

    def _take(self) -> tuple[str, bool]:
        if self.stop:
            window_start = max(0, self.emitted - max(map(len, self.stop)) + 1)
            hits = [i for i in (self.text.find(s, window_start) for s in self.stop) if i >= 0]
            if hits:
                end = min(hits)
                out, self.emitted = self.text[self.emitted : end], end
                return out, True
            hold = self._held_back()
        else:
            hold = 0
        end = len(self.text) - hold
        out = self.text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out, False

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that begins some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        out, self.emitted = self.text[self.emitted :], len(self.text)
        return out
