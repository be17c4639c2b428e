"""The sampler takes every value SamplingParams admits, and refuses what it cannot take; its logits processors
(logit_bias, the penalties, min_tokens, top_k, min_p) compute what OpenAI and vLLM document."""

from __future__ import annotations

import pytest
import torch

from headrace.plugins.engines.llm.sampling import (Detokenizer, History, apply_bitmask, make_generator, process_logits,
                                                   sample)
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
    {"presence_penalty": 2.1}, {"frequency_penalty": -2.1}, {"repetition_penalty": 0.0}, {"top_k": -2},
    {"min_p": 1.5}, {"min_tokens": 5, "max_tokens": 4}, {"logit_bias": {-1: 1.0}}, {"stop_token_ids": (-3,)},
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


def test_penalties_and_bias_compute_what_openai_and_vllm_document():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, logit_bias={2: 10.0}),
              SamplingParams(),  # all off: left as it is
              SamplingParams(repetition_penalty=2.0)]
    history = [History(output=[0, 0, 1]), History(output=[0, 3]), History(prompt=[1], output=[0])]
    out = process_logits(logits, params, history)
    # Output counts 2, 1: minus count * 0.5 and 0.25 each; the bias added.
    assert out[0].tolist() == [2.0 - 1.0 - 0.25, -1.0 - 0.5 - 0.25, 10.5, 3.0]
    assert out[1].tolist() == logits[1].tolist()
    # Prompt token 1 (negative: times 2) and output token 0 (positive: halved).
    assert out[2].tolist() == [1.0, -2.0, 0.5, 3.0]
    assert logits[0, 0] == 2.0  # the engine's logits (what logprobs read) are not touched
    assert process_logits(logits, [SamplingParams()] * 3, [History()] * 3) is logits


def test_min_tokens_bans_the_stops_until_reached_unless_nothing_else_is_left():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    params = SamplingParams(temperature=0, min_tokens=2, max_tokens=4)
    history = [History(output=[2], stops=frozenset({1})), History(output=[2, 2], stops=frozenset({1})),
               History(output=[], stops=frozenset({0, 1, 2}))]
    assert sample(logits, [params] * 3, gens(3), None, history) == [2, 1, 1]


def test_top_k_and_min_p_cut_the_tail_of_a_sampled_row():
    logits = torch.tensor([[1.0, 3.0, 2.9, 2.8, 0.0]] * 2)
    for seed in range(20):
        picks = sample(logits, [SamplingParams(temperature=2.0, top_k=1), SamplingParams(temperature=2.0, min_p=1.0)],
                       gens(2, seed))
        assert picks == [1, 1]
        assert sample(logits, [SamplingParams(temperature=2.0, top_k=2)], gens(1, seed))[0] in (1, 2)
        # min_p 0.9 of the top token's probability after temperature: 2.9 and 2.8 stay, 1.0 and 0.0 go.
        assert sample(logits, [SamplingParams(temperature=2.0, min_p=0.9)], gens(1, seed))[0] in (1, 2, 3)
    seen = {sample(logits, [SamplingParams(temperature=2.0, top_k=-1)], gens(1, seed))[0] for seed in range(40)}
    assert len(seen) > 2  # -1: off


class _Chars:
    """A tokenizer whose token t is the character chr(t)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def test_a_stop_string_counts_only_past_min_tokens():
    detok = Detokenizer(_Chars(), stop=("ab",), min_tokens=3)
    steps = [detok.add(ord(c)) for c in "abxab"]
    assert steps[:3] == [("a", False), ("b", False), ("x", False)]  # "ab" within the first 3 tokens: no stop
    assert steps[3] == ("", False) and steps[4] == ("", True)  # the "ab" past them stops, unsaid
    detok = Detokenizer(_Chars(), stop=("xa",), min_tokens=2)
    assert [detok.add(ord(c)) for c in "bxa"][-1] == ("", True)  # begins in the first 2 tokens, ends past them
