"""An LLM request's n choices: the prompt is filled once and forked, and each choice samples with its own seed."""

from __future__ import annotations

import time

import pytest

from conftest import idle
from headrace.graph.service import choice_params
from headrace.plugins.protocols import SEED_MAX, SEED_MIN, SamplingParams


def test_each_choice_of_a_seeded_request_gets_its_own_seed():
    params = SamplingParams(seed=7)
    assert [choice_params(params, j).seed for j in range(3)] == [7, 8, 9]
    assert choice_params(SamplingParams(seed=SEED_MAX), 1).seed == SEED_MIN  # wrapped, still a valid seed
    assert choice_params(SamplingParams(), 2).seed is None  # unseeded: each choice's generator seeds itself


@pytest.mark.slow
def test_n_choices_fill_the_prompt_once(live):
    portal, svc, pool = live
    engine = pool.slots["smollm2"].engine
    # A prompt no earlier test cached, so every token the engine fills is counted here.
    prompt = engine.chat_tokens([{"role": "user", "content": f"Tell me about the mill on day {time.time_ns()}: "
                                  "its wheel, its race, its miller and the river that drives it."}])
    before = engine.core.token_counts["prefill"]

    async def choices():
        out: dict[int, list[int]] = {}
        params = SamplingParams(max_tokens=3, temperature=1.0, seed=5)
        async for c in svc.generate_choices("smollm2", [prompt, prompt[:12]], params, n=4):
            out.setdefault(c.index, []).extend(c.delta.token_ids)
        return out

    out = portal.call(choices)
    assert sorted(out) == list(range(8)) and all(out.values())
    filled = engine.core.token_counts["prefill"] - before
    # Each prompt once, less its last token, which each of its 4 choices fills on its fork.
    assert filled <= len(prompt) + 12 + 2 * 3
    deadline = time.monotonic() + 10
    while not idle(engine.stats()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert idle(engine.stats())
