"""Token sampling and incremental detokenisation, shared by the cores of in-process LLM engines."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

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


@dataclass(eq=False)  # compared by identity: rows share the empty one
class History:
    """What a row's logits processors read: its prompt (``repetition_penalty``), its output so far (the
    penalties, ``min_tokens``), and the tokens ``min_tokens`` holds back (EOS and ``stop_token_ids``)."""

    prompt: Sequence[int] = ()
    output: Sequence[int] = ()
    stops: frozenset[int] = frozenset()
    _prompt_ids: torch.Tensor | None = field(default=None, repr=False)

    def prompt_ids(self) -> torch.Tensor:
        if self._prompt_ids is None:  # the prompt does not change while the row decodes: converted once
            self._prompt_ids = torch.tensor(list(self.prompt), dtype=torch.long)
        return self._prompt_ids


NO_HISTORY = History()


def _pairs(values: list[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(j, token) index tensors of every token of ``values[j]``, for every j."""
    counts = torch.tensor([len(v) for v in values], dtype=torch.long)
    tokens = torch.tensor([t for v in values for t in v], dtype=torch.long)
    return torch.arange(len(values)).repeat_interleave(counts), tokens


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                   history: Sequence[History]) -> torch.Tensor:
    """``logits`` (B, V) as vLLM's sampler has them before greedy or random sampling: ``logit_bias`` added, the
    repetition, frequency and presence penalties applied, and EOS and ``stop_token_ids`` banned in rows short of
    their ``min_tokens``. A copy in float32 where any row changes; ``logits`` itself (the engine's, which its
    logprobs read raw, as vLLM reports them) where none does.

    Vectorised over the rows that change, and sparse: each setting touches only the tokens it names or the row
    has seen (one (B, V) copy in all), so a step's cost grows with those tokens, not with the vocabulary."""
    rows = [i for i, p in enumerate(params) if not p.neutral_logits]
    if not rows:
        return logits
    width = logits.shape[1]
    out = logits.to(torch.float32, copy=True)
    biased = [i for i in rows if params[i].logit_bias]
    if biased:
        at, ids = _pairs([[t for t, _ in params[i].logit_bias] for i in biased])
        values = torch.tensor([b for i in biased for _, b in params[i].logit_bias], dtype=torch.float32)
        out.index_put_((torch.tensor(biased)[at], ids), values, accumulate=True)
    penalised = [i for i in rows if params[i].repetition_penalty != 1 or params[i].frequency_penalty
                 or params[i].presence_penalty]
    if penalised:
        index = torch.tensor(penalised)
        # Each row's distinct output tokens and their counts: one unique() over (row, token) keys.
        at, ids = _pairs([history[i].output for i in penalised])
        keys, counts = torch.unique(at * width + ids, return_counts=True)
        repeated = [k for k, i in enumerate(penalised) if params[i].repetition_penalty != 1]
        if repeated:  # HF's rule, as vLLM applies it: every token of the prompt or the output, once
            prompts = [history[penalised[k]].prompt_ids() for k in repeated]
            prompt_at = torch.tensor(repeated).repeat_interleave(torch.tensor([len(p) for p in prompts]))
            seen = torch.unique(torch.cat([keys, prompt_at * width + torch.cat(prompts)]))
            penalty = torch.tensor([params[i].repetition_penalty for i in penalised])[seen // width]
            where = (index[seen // width], seen % width)
            values = out[where]
            out[where] = torch.where(values > 0, values / penalty, values * penalty)
        freq = torch.tensor([params[i].frequency_penalty for i in penalised])[keys // width]
        pres = torch.tensor([params[i].presence_penalty for i in penalised])[keys // width]
        where = (index[keys // width], keys % width)
        out[where] = out[where] - freq * counts - pres
    short = [i for i in rows if len(history[i].output) < params[i].min_tokens and history[i].stops]
    if short:
        index = torch.tensor(short)
        at, ids = _pairs([sorted(t for t in history[i].stops if t < width) for i in short])
        before = out[index[at], ids]
        out.index_put_((index[at], ids), torch.tensor(float("-inf")))
        # A grammar that allows nothing but ending keeps its end (vLLM restores it too): never a row of no token.
        stuck = ~torch.isfinite(out[index]).any(dim=-1)
        if bool(stuck.any()):
            undo = stuck[at]
            out[index[at][undo], ids[undo]] = before[undo]
    return out


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator],
           bitmask: torch.Tensor | None = None, history: Sequence[History] | None = None) -> list[int]:
    """One token per row of ``logits`` (B, V), each row with its own params, RNG and ``history``.

    In vLLM's order: ``bitmask`` (rows of a constrained decode's allowed tokens, see ``apply_bitmask``), so
    greedy and sampled rows alike pick only allowed tokens; then ``process_logits`` (bias, penalties,
    min_tokens); greedy rows take the argmax; sampled rows are divided by their temperature, then cut by
    min_p, top_k and top_p. Every value ``SamplingParams`` admits works: tiny temperatures are greedy, a
    top_p that rounds to 0 keeps the top token, and a row whose distribution is not finite (NaN logits)
    falls back to its argmax rather than failing. Rows whose settings are all off cost nothing extra.
    """
    if bitmask is not None:
        logits = apply_bitmask(logits, bitmask)
    logits = process_logits(logits, params, history if history is not None else [NO_HISTORY] * len(params))
    greedy = logits.argmax(dim=-1).tolist()
    sampled_rows = [i for i, p in enumerate(params) if not is_greedy(p)]
    if not sampled_rows:
        return greedy
    rows = torch.tensor(sampled_rows)
    ps = [params[i] for i in sampled_rows]
    temps = torch.tensor([p.temperature for p in ps], dtype=torch.float32).unsqueeze(1)
    scaled = logits[rows].float() / temps
    min_ps = torch.tensor([p.min_p for p in ps], dtype=torch.float32).unsqueeze(1)
    if bool((min_ps > 0).any()):
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * min_ps, float("-inf"))
    width = scaled.shape[1]
    top_ks = [min(p.top_k, width) if p.top_k >= 1 else width for p in ps]
    if min(top_ks) < width:
        # The k-th largest logit of each row; ties with it stay in, as in vLLM.
        kth = scaled.topk(max(top_ks), dim=-1).values.gather(1, torch.tensor(top_ks).unsqueeze(1) - 1)
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    top_ps = torch.tensor([p.top_p for p in ps], dtype=torch.float32).unsqueeze(1)
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
    string. A stop string counts only where it ends past the text of the first ``min_tokens`` tokens
    (vLLM's rule): before that, text is handed out as it comes.
    """

    tokenizer: object
    stop: tuple[str, ...] = ()
    min_tokens: int = 0
    ids: list[int] = field(default_factory=list)
    text: str = ""  # everything decoded so far
    emitted: int = 0  # chars of ``text`` already handed out
    _prefix_offset: int = 0
    _read_offset: int = 0
    _stops_from: int = 0  # a stop string must end past this many chars of ``text``
    # The Rust tokenizer and its own incremental decoder, where there is one (__post_init__).
    _backend: Tokenizer | None = field(default=None, init=False, repr=False)
    _stream: DecodeStream | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        # tokenizers' DecodeStream (as vLLM's fast detokenizer) does the window below in one Rust call: two
        # transformers decode calls took 54 us a token right after a llama_decode (issue 51, AMD EPYC). Not
        # where transformers cleans up spaces after decoding, which the stream does not.
        backend = getattr(self.tokenizer, "_tokenizer", None)
        if isinstance(backend, Tokenizer) and not getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            self._backend, self._stream = backend, DecodeStream(skip_special_tokens=True)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)  # type: ignore[attr-defined]

    def add(self, token_id: int) -> tuple[str, bool]:
        """Append a token; return (new text to emit, whether a stop string ended it)."""
        self.ids.append(token_id)
        if self._stream is not None:
            self.text += self._stream.step(self._backend, token_id) or ""
        else:
            prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
            full = self._decode(self.ids[self._prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix) :]
                self._prefix_offset = self._read_offset
                self._read_offset = len(self.ids)
        if len(self.ids) == self.min_tokens:
            self._stops_from = len(self.text)
        return self._take()

    def _take(self) -> tuple[str, bool]:
        # Stop strings count past min_tokens; on text added without its tokens (add_text: SGLang's), always.
        if self.stop and (len(self.ids) > self.min_tokens or not self.ids):
            window_start = max(0, self.emitted - max(map(len, self.stop)) + 1)
            hits = [i for i in (self.text.find(s, max(window_start, self._stops_from - len(s) + 1))
                                for s in self.stop) if i >= 0]
            if hits:
                # Past min_tokens, a stop string may begin in text already handed out: the rest is cut.
                end = max(min(hits), self.emitted)
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
