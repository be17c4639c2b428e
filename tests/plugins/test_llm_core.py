"""llm_core's shared row sampling: the numpy path (llama.cpp's logits) picks what the torch sampler picks."""

from __future__ import annotations

import numpy as np
import torch

from headrace.plugins.engines.llm_core import Row, logprobs_row, sample_rows, sample_rows_numpy
from headrace.plugins.engines.sampling import Detokenizer, make_generator
from headrace.plugins.protocols import SamplingParams

PARAMS = [SamplingParams(temperature=0.0, max_tokens=4), SamplingParams(temperature=1.0, seed=7, max_tokens=4),
          SamplingParams(temperature=0.0, max_tokens=4, logprobs=2), SamplingParams(temperature=0.7, seed=3, top_p=0.5,
                                                                                   max_tokens=4)]


def rows() -> list[Row]:
    return [Row(ctx=f"c{i}", params=p, send=None, free_after=True, priority=0, generator=make_generator(p.seed),
                detok=Detokenizer(None), length=1) for i, p in enumerate(PARAMS)]


def test_numpy_rows_sample_as_the_torch_sampler_does_greedy_and_seeded_alike():
    logits = np.random.default_rng(0).standard_normal((len(PARAMS), 1000)).astype(np.float32)
    logits[0, 17] = logits[2, 998] = 50.0  # the greedy rows' answers, away from index 0
    got = sample_rows_numpy(rows(), logits)
    assert got == sample_rows(rows(), torch.from_numpy(logits.copy()))
    assert got[0] == 17 and got[2] == 998
    # Seeded rows really sample (a seed's draw is not the argmax for every seed): draws differ across seeds.
    draws = set()
    for seed in range(20):
        r = rows()[1]
        r.generator = make_generator(seed)
        draws.add(sample_rows_numpy([r], logits[1:2])[0])
    assert len(draws) > 1


def test_only_a_row_that_asked_for_logprobs_gets_its_logits_as_a_tensor():
    row = np.arange(5, dtype=np.float32)
    plain, wants = rows()[0], rows()[2]
    assert logprobs_row(plain, row) is None
    assert torch.equal(logprobs_row(wants, row), torch.from_numpy(row))
