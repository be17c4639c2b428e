"""Constrained decoding on both built-in engines with the real SmolLM2: whatever the model prefers, the
output matches the constraint, and a finished grammar ends the decode with "stop"."""

from __future__ import annotations

import json

import jsonschema
import pytest

from headrace.plugins.engines.llm.chat import format_tool_call
from headrace.plugins.engines.llm.front import EngineError
from headrace.plugins.protocols import JsonSchemaConstraint, LarkConstraint, SamplingParams

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"],
        "additionalProperties": False}


@pytest.fixture(params=["torch", "llama-cpp"])
def llm(request):
    """(portal, engine): the session's engine of each kind (conftest's, shared with the other engine tests)."""
    portal, engine, _ = request.getfixturevalue({"torch": "torch_smollm2", "llama-cpp": "llama_cpp_smollm2"}[request.param])
    return portal, engine


async def generate(engine, prompt: str, params: SamplingParams) -> tuple[str, str | None]:
    tokens = engine.chat_tokens([{"role": "user", "content": prompt}])
    parts, finish = [], None
    async for d in engine.generate(tokens, params):
        parts.append(d.text)
        finish = d.finish_reason
    return "".join(parts), finish


def test_a_json_schema_holds_greedy_and_sampled(llm):
    portal, engine = llm
    constraint = JsonSchemaConstraint(json.dumps(PERSON))
    for params in (SamplingParams(max_tokens=48, temperature=0, constraint=constraint),
                   SamplingParams(max_tokens=48, temperature=1.0, seed=7, constraint=constraint)):
        # A prompt that asks for something else: the constraint, not the prompt, makes it JSON.
        text, finish = portal.call(generate, engine, "Write a haiku about rivers.", params)
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)


def test_constrained_and_free_rows_share_a_batch(llm):
    portal, engine = llm
    constraint = JsonSchemaConstraint(json.dumps({"type": "array", "items": {"type": "integer", "maximum": 99},
                                                  "minItems": 2, "maxItems": 3}))

    async def both():
        import anyio

        results: dict[str, tuple[str, str | None]] = {}

        async def one(key, params):
            results[key] = await generate(engine, "List some numbers.", params)

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "json", SamplingParams(max_tokens=32, temperature=0, constraint=constraint))
            tg.start_soon(one, "free", SamplingParams(max_tokens=8, temperature=0))
        return results

    results = portal.call(both)
    items = json.loads(results["json"][0])
    assert results["json"][1] == "stop" and 2 <= len(items) <= 3 and all(isinstance(i, int) for i in items)
    assert results["free"][0] and not results["free"][0].startswith("[")  # the free row is not masked


def test_a_lark_grammar_of_tool_calls_holds(llm):
    portal, engine = llm
    grammar = ('start: call\ncall: "<tool_call>\\n" body "\\n</tool_call>"\n'
               'body: %json ' + json.dumps({"type": "object", "properties": {"name": {"const": "get_weather"},
                                                                        "arguments": CITY},
                                           "required": ["name", "arguments"], "additionalProperties": False,
                                           # compact, as the daemon's tool grammars ask
                                           "x-guidance": {"whitespace_flexible": False, "item_separator": ", ",
                                                          "key_separator": ": "}}))
    params = SamplingParams(max_tokens=48, temperature=0, constraint=LarkConstraint(grammar))
    text, finish = portal.call(generate, engine, "What is the weather in Paris?", params)
    assert finish == "stop", text
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    call = json.loads(text[len("<tool_call>\n"): -len("\n</tool_call>")])
    assert call["name"] == "get_weather"
    jsonschema.validate(call["arguments"], CITY)
    assert format_tool_call(call["name"], call["arguments"]) == text  # the format the daemon parses


def test_a_constraint_that_does_not_compile_fails_its_request_alone(llm):
    portal, engine = llm
    bad = SamplingParams(max_tokens=8, temperature=0, constraint=LarkConstraint("start: undefined_rule"))
    with pytest.raises(EngineError, match="constraint"):
        portal.call(generate, engine, "Hi", bad)
    text, finish = portal.call(generate, engine, "Hi", SamplingParams(max_tokens=4, temperature=0))
    assert text and finish in ("stop", "length")
