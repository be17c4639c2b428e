"""KL divergence and top-1 agreement of an engine's next-token distributions against a reference's.

Rows are log-softmax distributions over the vocabulary, one per scored position, shape (positions, vocab), the
reference's and the engine's for the same positions. Both are renormalised in float64 before the KL, so rows
stored in float16 or computed in float32 (whose sums are 1 only to their precision) and raw logits compare alike.

A row that is all NaN in either is a position the engine (or the reference) gave no score: it is skipped and
counted. A row with some NaN (or an engine ``-inf`` where the reference has mass) is a wrong number, not a missing
one: its KL is ``inf`` and its top-1 disagrees, so it can never pass unnoticed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class TokenScores:
    """One prompt's scored positions: per-token KL(reference || engine) in nats (float64) and top-1 agreement."""

    kl: torch.Tensor  # (scored,), float64
    top1: torch.Tensor  # (scored,), bool: the engine's most likely token is the reference's
    skipped: int = 0  # rows with no score (all NaN), left out of both


@dataclass(frozen=True)
class QualityStats:
    """Many prompts' scored positions, summarised: KL in nats, top-1 agreement as a fraction."""

    tokens: int
    mean_kl: float
    p99_kl: float  # nearest rank: the smallest KL at least 99% of the tokens are at or below
    max_kl: float
    top1: float
    skipped: int = 0

    def as_dict(self) -> dict[str, float | int]:
        return {"tokens": self.tokens, "mean_kl": self.mean_kl, "p99_kl": self.p99_kl, "max_kl": self.max_kl,
                "top1": self.top1, "skipped": self.skipped}


def _rows(rows: Any) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(rows) if not isinstance(rows, torch.Tensor) else rows).to(torch.float64)
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2:
        raise ValueError(f"rows must be 2-D (positions, vocab), not of shape {tuple(t.shape)}")
    return t


def _unscored(rows: torch.Tensor) -> torch.Tensor:
    return torch.isnan(rows).all(dim=-1)


def compare(reference: Any, engine: Any) -> TokenScores:
    """Per-position KL(reference || engine) and top-1 agreement of two equally shaped sets of rows."""
    ref, eng = _rows(reference), _rows(engine)
    if ref.shape != eng.shape:
        raise ValueError(f"reference rows {tuple(ref.shape)} and engine rows {tuple(eng.shape)} differ in shape")
    scored = ~(_unscored(ref) | _unscored(eng))
    ref, eng = ref[scored], eng[scored]
    return TokenScores(kl_rows(ref, eng), top1_rows(ref, eng), int((~scored).sum()))


def kl_rows(reference: torch.Tensor, engine: torch.Tensor) -> torch.Tensor:
    """KL(reference || engine) per row, in nats, computed in float64 (no row skipped)."""
    ref = torch.log_softmax(_rows(reference), dim=-1)
    eng = torch.log_softmax(_rows(engine), dim=-1)
    p = ref.exp()
    # 0 * log(0 / q) is 0: a token the reference gives no mass adds nothing, whatever the engine gives it.
    terms = torch.where(p > 0, p * (ref - eng), torch.zeros((), dtype=torch.float64))
    kl = terms.sum(dim=-1)
    bad = torch.isnan(kl) | torch.isnan(eng).any(dim=-1) | torch.isnan(ref).any(dim=-1)
    return torch.where(bad, torch.full((), math.inf, dtype=torch.float64), kl.clamp_min(0.0))


def top1_rows(reference: torch.Tensor, engine: torch.Tensor) -> torch.Tensor:
    """Per row: is the engine's most likely token the reference's? (A row with NaN never agrees.)"""
    ref, eng = _rows(reference), _rows(engine)
    nan = torch.isnan(ref).any(dim=-1) | torch.isnan(eng).any(dim=-1)
    return (ref.argmax(dim=-1) == eng.argmax(dim=-1)) & ~nan


def summarize(scores: Iterable[TokenScores]) -> QualityStats:
    """Every prompt's positions pooled: mean, p99 and max KL, and the top-1 agreement over all tokens."""
    scores = list(scores)
    skipped = sum(s.skipped for s in scores)
    kl = torch.cat([s.kl.to(torch.float64).reshape(-1) for s in scores]) if scores else torch.empty(0,
                                                                                                   dtype=torch.float64)
    if kl.numel() == 0:
        return QualityStats(0, math.nan, math.nan, math.nan, math.nan, skipped)
    top1 = torch.cat([s.top1.reshape(-1) for s in scores])
    ordered = torch.sort(kl).values
    p99 = ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]  # nearest rank: no interpolation across an inf
    return QualityStats(int(kl.numel()), float(kl.mean()), float(p99), float(ordered[-1]),
                        float(top1.to(torch.float64).mean()), skipped)


def identical_fraction(ref_answers: Sequence[Sequence[int]], engine_answers: Sequence[Sequence[int]]) -> float:
    """The fraction of answers (token id lists, one per prompt) that are the reference's token for token."""
    if len(ref_answers) != len(engine_answers):
        raise ValueError(f"{len(ref_answers)} reference answers but {len(engine_answers)} engine answers")
    if not ref_answers:
        return math.nan
    same = sum(list(a) == list(b) for a, b in zip(ref_answers, engine_answers))
    return same / len(ref_answers)


def matching_prefix(ref_answer: Sequence[int], engine_answer: Sequence[int]) -> int:
    """How many leading tokens two answers share: where a greedy continuation first took another token."""
    n = 0
    for a, b in zip(ref_answer, engine_answer):
        if a != b:
            break
        n += 1
    return n
