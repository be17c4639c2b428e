"""The quality metrics' arithmetic, on distributions whose KL is known by hand."""

import math

import pytest
import torch

from headrace.quality.metrics import (QualityStats, TokenScores, compare, identical_fraction, kl_rows,
                                      matching_prefix, summarize)


def logs(*probs: float) -> list[float]:
    return [math.log(p) if p > 0 else -math.inf for p in probs]


def test_identical_rows_have_zero_kl_and_agree():
    rows = torch.log_softmax(torch.randn(5, 100, generator=torch.Generator().manual_seed(0)), dim=-1)
    scores = compare(rows, rows.clone())
    assert scores.kl.dtype == torch.float64
    assert torch.all(scores.kl.abs() < 1e-12)
    assert scores.top1.all() and scores.skipped == 0


def test_a_known_pair_gives_its_known_kl():
    # KL((1/2, 1/2) || (1/4, 3/4)) = 1/2 ln 2 + 1/2 ln(2/3)
    kl = compare([logs(0.5, 0.5)], [logs(0.25, 0.75)]).kl
    assert kl.item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3), rel=1e-12)
    # and it is not symmetric: KL((1/4, 3/4) || (1/2, 1/2)) = 1/4 ln(1/2) + 3/4 ln(3/2)
    back = compare([logs(0.25, 0.75)], [logs(0.5, 0.5)]).kl
    assert back.item() == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5), rel=1e-12)


def test_raw_logits_and_float16_rows_are_renormalised():
    # The same distribution as logits shifted by a constant, and rounded to float16: KL stays ~0.
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(1))
    ref = torch.log_softmax(logits, dim=-1).to(torch.float16)
    assert compare(ref, logits + 7.0).kl.max().item() < 1e-5


def test_a_token_the_reference_never_gives_adds_nothing_but_one_it_does_is_infinite():
    assert compare([logs(1.0, 0.0)], [logs(0.9, 0.1)]).kl.item() == pytest.approx(-math.log(0.9))
    assert compare([logs(0.5, 0.5)], [logs(1.0, 0.0)]).kl.item() == math.inf


def test_nan_rows_are_skipped_and_counted():
    ref = torch.tensor([logs(0.5, 0.5), logs(0.2, 0.8), logs(0.9, 0.1)])
    eng = torch.tensor([logs(0.5, 0.5), [math.nan, math.nan], logs(0.1, 0.9)])
    scores = compare(ref, eng)
    assert scores.skipped == 1 and len(scores.kl) == 2
    assert scores.kl[0].item() == pytest.approx(0.0, abs=1e-15)
    assert scores.top1.tolist() == [True, False]


def test_a_row_with_some_nan_is_a_wrong_number_not_a_missing_one():
    scores = compare([logs(0.5, 0.25, 0.25)], [[math.log(0.5), math.nan, math.log(0.25)]])
    assert scores.skipped == 0 and scores.kl.item() == math.inf and not scores.top1.item()


def test_summary_pools_every_prompt():
    a = TokenScores(torch.tensor([0.0, 0.1], dtype=torch.float64), torch.tensor([True, True]))
    b = TokenScores(torch.tensor([0.4], dtype=torch.float64), torch.tensor([False]), skipped=2)
    stats = summarize([a, b])
    assert stats == QualityStats(tokens=3, mean_kl=pytest.approx(0.5 / 3), p99_kl=0.4, max_kl=0.4,
                                 top1=pytest.approx(2 / 3), skipped=2)
    many = TokenScores(torch.arange(1, 201, dtype=torch.float64) / 100, torch.ones(200, dtype=torch.bool))
    assert summarize([many]).p99_kl == pytest.approx(1.98)  # nearest rank: the 198th of 200
    assert summarize([]).tokens == 0 and math.isnan(summarize([]).mean_kl)


def test_kl_rows_agrees_with_torch_kl_div():
    g = torch.Generator().manual_seed(2)
    ref = torch.log_softmax(torch.randn(4, 50, generator=g, dtype=torch.float64), dim=-1)
    eng = torch.log_softmax(torch.randn(4, 50, generator=g, dtype=torch.float64), dim=-1)
    expected = torch.nn.functional.kl_div(eng, ref, log_target=True, reduction="none").sum(-1)
    assert torch.allclose(kl_rows(ref, eng), expected, rtol=1e-12, atol=0)


def test_identical_answers():
    assert identical_fraction([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]) == 0.5
    assert math.isnan(identical_fraction([], []))
    with pytest.raises(ValueError):
        identical_fraction([[1]], [])
    assert matching_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
