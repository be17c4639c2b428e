"""An LLM request's n choices: the prompt is filled once and forked, and each choice samples with its own seed."""

from __future__ import annotations

import time

import pytest

from conftest import idle
from headrace.graph.graph import Op
from headrace.graph.objectives import task_groups
from headrace.graph.request import choice_params, request_graph
from headrace.plugins.protocols import SEED_MAX, SEED_MIN, SamplingParams


def test_each_choice_of_a_seeded_request_gets_its_own_seed():
    params = SamplingParams(seed=7)
    assert [choice_params(params, j).seed for j in range(3)] == [7, 8, 9]
    assert choice_params(SamplingParams(seed=SEED_MAX), 1).seed == SEED_MIN  # wrapped, still a valid seed
    assert choice_params(SamplingParams(), 2).seed is None  # unseeded: each choice's generator seeds itself


def test_request_graph_forks_a_shared_prefix_per_choice():
    built = request_graph("lm", [[1, 2, 3], [4]], SamplingParams(max_tokens=5, seed=3), n=2)
    g = built.graph
    assert sorted(built.choice_of.values()) == [0, 1, 2, 3]
    prefix = g.nodes["p0.prefix"]
    assert (prefix.op, prefix.params["tokens"], prefix.size, prefix.engine) == (Op.PREFILL, [1, 2], 2, "lm")
    for decode_id, index in built.choice_of.items():
        decode = g.nodes[decode_id]
        prefill = g.nodes[g.producer(decode.inputs[0])]
        assert decode.op == Op.DECODE and decode.size == 5 and decode.engine == prefill.engine == "lm"
        assert decode.params["sampling"].seed == 3 + index % 2  # prompt i's j-th choice samples with seed + j
        if index < 2:  # the three-token prompt: each choice fills its last token on a fork of the prefix
            assert prefill.op == Op.FULL_PREFILL and prefill.params["tokens"] == [3] and prefill.size == 1
            assert prefill.params["parent"] == prefix.outputs[0] and prefill.inputs == prefix.outputs
        else:  # a one-token prompt has no prefix to share: each choice prefills it whole
            assert prefill.op == Op.PREFILL and prefill.params["tokens"] == [4] and prefill.inputs == ()
        assert prefill.prefix_hash is None  # a tokenized prompt has no text to hash
    assert len(g.nodes) == 1 + 2 * 4
    assert task_groups(g) == {}  # the choices of one request are not a task group


def test_request_graph_without_choices_to_share_prefills_each_prompt_once():
    g = request_graph("lm", [[1, 2, 3]], SamplingParams(max_tokens=4)).graph
    assert sorted(n.op for n in g.nodes.values()) == sorted([Op.PREFILL, Op.DECODE])
    assert {e.var for e in g.edges} == {next(n for n in g.nodes.values() if n.op == Op.PREFILL).outputs[0]}


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
