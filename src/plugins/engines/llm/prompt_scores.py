"""Teacher-forced scoring of a prefill (``ScoresPrompts.prompt_logprobs``), engine-neutral.

A scored prefill asks its core for the logits at every position; the core hands each chunk's rows to a
:class:`PromptScorer`, which keeps only what the caller asked for (each token's log-probability, its top
alternatives, the whole rows with ``full``), so a long prompt never holds (tokens x vocab) floats it will not
return. Row ``i`` of a prefill's logits is the distribution of token ``i + 1``; the first token is scored by
the parent context's last logits, or not at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from headrace.plugins.protocols import PromptLogprobs, TokenLogprob


@dataclass(frozen=True)
class PromptScoring:
    """What a scored prefill returns besides filling its context (``Prefill.scoring``)."""

    top: int = 0  # alternatives per scored token
    full: bool = False  # the whole log-softmax rows too


class PromptScorer:
    """One scored prefill's scores, gathered chunk by chunk as its logits come out of the engine."""

    def __init__(self, tokens: Sequence[int], scoring: PromptScoring, first: np.ndarray | torch.Tensor | None) -> None:
        self._tokens = list(tokens)
        self._scoring = scoring
        self._scores: list[TokenLogprob | None] = [None]
        self._rows: list[torch.Tensor] = []
        if scoring.full:
            self._rows.append(torch.full((1, 0), float("nan")))  # widened once the vocabulary is known
        if first is not None:
            self._scores, self._rows = [], []
            self._add(torch.as_tensor(np.asarray(first, dtype=np.float32)).reshape(1, -1), [self._tokens[0]])
        self._done = 0  # logits rows received: row k scores token k + 1

    def add(self, logits: np.ndarray | torch.Tensor) -> None:
        """The next chunk's logits, a row per prefilled token in order."""
        n = len(logits)
        targets = self._tokens[self._done + 1 : self._done + 1 + n]
        self._done += n
        if targets:
            self._add(torch.as_tensor(logits[: len(targets)]).float(), targets)

    def _add(self, logits: torch.Tensor, targets: list[int]) -> None:
        rows = torch.log_softmax(logits, dim=-1)
        index = torch.tensor(targets)
        picked = rows[torch.arange(len(targets)), index]
        chosen = picked.tolist()
        ranks = ((rows > picked[:, None]).sum(dim=1) + 1).tolist()  # vLLM's rank: 1 + the tokens more likely
        if self._scoring.top:
            values, ids = torch.topk(rows, self._scoring.top, dim=-1)
            tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        else:
            tops = [()] * len(targets)
        self._scores += [TokenLogprob(t, lp, top, rank) for t, lp, top, rank in zip(targets, chosen, tops, ranks)]
        if self._scoring.full:
            self._rows.append(rows)

    def result(self) -> PromptLogprobs:
        if len(self._scores) != len(self._tokens):
            raise RuntimeError(f"scored {len(self._scores)} of {len(self._tokens)} tokens")
        rows = None
        if self._scoring.full:
            width = next((r.shape[1] for r in self._rows if r.shape[1]), 0)
            rows = torch.cat([r if r.shape[1] else torch.full((1, width), float("nan")) for r in self._rows])
        return PromptLogprobs(tuple(self._scores), rows)
