"""The sampler takes every value SamplingParams admits, and refuses what it cannot take."""

from __future__ import annotations

import pytest
import torch

from headrace.plugins.engines.sampling import apply_bitmask, make_generator, sample
from headrace.plugins.protocols import SEED_MAX, SEED_MIN, SamplingParams

LOGITS = torch.tensor([[0.5, 3.0, 1.0, -2.0], [2.0, 0.1, 0.2, 0.3]])


def gens(n: int, seed: int = 0) -> list[torch.Generator]:
    return [make_generator(seed) for _ in range(n)]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1e-40),
    SamplingParams(temperature=1e-6),
    SamplingParams(temperature=1.0, top_p=1e-300),  # 0 in float32
    SamplingParams(temperature=1e-5, top_p=1e-300),
    SamplingParams(temperature=1e-40, top_p=1e-300),
])
def test_extreme_values_pick_the_top_token(params):
    assert sample(LOGITS, [params, params], gens(2)) == [1, 0]


def test_huge_temperature_and_extreme_seeds_sample_a_valid_token():
    for seed in (SEED_MIN, -1, 0, 2**63, SEED_MAX):
        params = SamplingParams(temperature=1e30, seed=seed)
        tokens = sample(LOGITS.to(torch.bfloat16), [params, params], [make_generator(seed)] * 2)
        assert all(0 <= t < LOGITS.shape[1] for t in tokens)


def test_a_row_without_a_finite_distribution_falls_back_to_its_argmax():
    logits = LOGITS.clone()
    logits[0, 2] = float("nan")
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0)]
    tokens = sample(logits, params, gens(2))
    assert tokens[1] == 0 and 0 <= tokens[0] < LOGITS.shape[1]


@pytest.mark.parametrize("bad", [
    {"seed": SEED_MAX + 1}, {"seed": SEED_MIN - 1}, {"temperature": float("nan")},
    {"temperature": float("inf")}, {"temperature": -1e-9}, {"top_p": 0.0}, {"top_p": float("nan")},
])
def test_sampling_params_refuse_what_no_sampler_can_take(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_a_bitmask_confines_greedy_and_sampled_rows_to_allowed_tokens():
    logits = torch.randn(2, 70)
    mask = torch.zeros(2, 3, dtype=torch.int32)  # 96 bits for 70 tokens
    mask[0, 1] = 1 << 5  # row 0: only token 37
    mask[1, 2] = (1 << 1) | (1 << 3)  # row 1: tokens 65 and 67
    greedy, hot = SamplingParams(temperature=0), SamplingParams(temperature=2.0)
    for _ in range(20):
        assert sample(logits, [greedy, hot], gens(2), mask)[0] == 37
        assert sample(logits, [hot, hot], [make_generator(None), make_generator(None)], mask)[1] in (65, 67)


def test_an_all_ones_row_leaves_its_logits_alone():
    logits = torch.randn(3, 40)
    mask = torch.full((3, 2), -1, dtype=torch.int32)
    assert torch.equal(apply_bitmask(logits, mask), logits)
    mask[1, 0] = 0  # row 1 loses tokens 0-31
    masked = apply_bitmask(logits, mask)
    assert torch.isinf(masked[1, :32]).all() and torch.equal(masked[1, 32:], logits[1, 32:])
