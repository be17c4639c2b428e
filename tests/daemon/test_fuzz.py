"""Schemathesis over the daemon's own /openapi.json, against a real ``headrace serve``.

Every operation gets a few valid and invalid examples; none may answer 5xx or hang, every
error carries OpenAI's envelope, and afterwards the daemon is still ready and answering.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from conftest import API_KEY, metric_value

pytestmark = pytest.mark.slow

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
EXAMPLES = 15  # per operation and mode: 44 tests, about 3 minutes in all on 2 quiet cores
REQUEST_TIMEOUT = 180  # generous: a fuzzed workflow run waits on the models; a hang still fails
# Generation lengths are clamped so fuzzing checks validation, not decode speed.
MODELS = {"ChatCompletionRequest": "smollm2", "CompletionRequest": "smollm2", "EmbeddingRequest": "all-minilm-l6-v2",
          "RerankRequest": "smollm2-rerank", "TokenizeRequest": "smollm2", "TokenizeChatRequest": "smollm2",
          "DetokenizeRequest": "smollm2"}
# n multiplies the decodes as max_tokens lengthens them: both clamped. So do a traced workflow's
# agents, rounds and steps.
TOKEN_FIELDS = {"max_tokens": 4, "max_completion_tokens": 4, "context_tokens": 2, "n": 2,
                "agents": 2, "rounds": 2, "max_steps": 2}


def small(doc: Any, name: str | None = None) -> Any:
    """The schema with short strings and lists, so valid examples stay cheap to serve."""
    if isinstance(doc, list):
        return [small(item, name) for item in doc]
    if not isinstance(doc, dict):
        return doc
    out = {key: small(value, key if key not in ("anyOf", "oneOf", "allOf", "items") else name)
           for key, value in doc.items() if key != "properties"}
    if "properties" in doc:
        out["properties"] = {key: small(value, key) for key, value in doc["properties"].items()}
        # An omitted max_tokens means the server's default (256 for a chat): always send a small one.
        # So is a run's config, which holds its max_tokens.
        for key in ("max_tokens", "config"):
            if key in doc["properties"]:
                out["required"] = sorted({*out.get("required", ()), key})
    if out.get("type") == "string" and "enum" not in out:
        out.setdefault("maxLength", 64)
    if out.get("type") == "array":
        out.setdefault("maxItems", 3)
    if name in TOKEN_FIELDS and "anyOf" in out:  # null means the server's default length: never that
        out["anyOf"] = [alt for alt in out["anyOf"] if alt.get("type") != "null"]
    if name in TOKEN_FIELDS and out.get("type") == "integer":
        out["maximum"] = min(out.get("maximum", TOKEN_FIELDS[name]), TOKEN_FIELDS[name])
    return out


def clamp(body: Any) -> None:
    """Negative examples may still carry a huge but valid max_tokens: cap it (the rest stays fuzzed)."""
    if isinstance(body, dict):
        for key, value in body.items():
            if key in TOKEN_FIELDS and isinstance(value, int) and not isinstance(value, bool) and value > 8:
                body[key] = 8
            else:
                clamp(value)
    elif isinstance(body, list):
        for item in body:
            clamp(item)


def check(case, base_url: str) -> None:
    clamp(case.body)
    response = case.call(base_url=base_url, headers=HEADERS, timeout=REQUEST_TIMEOUT)
    assert response.status_code < 500, f"{case.method} {case.path}: {response.status_code} {response.text[:500]}"
    if response.status_code == 400 and response.text == "Invalid HTTP request received.":
        # uvicorn's HTTP parser refused the request line itself (a fuzzed path character it cannot carry):
        # the app never saw the request, so no OpenAI envelope can come back. Seen once on a fresh clone.
        return
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, response.text


def operations() -> list[str]:
    """Every operation of the published schema, built the way the daemon builds it (no models needed):
    one test each, so each has its own timeout and its own name when it fails."""
    from headrace.daemon.openapi import document
    from headrace.plugins.manager import collect

    doc = document(collect().workflows)
    return [f"{method.upper()} {path}" for path, item in doc["paths"].items()
            for method in item if method in ("get", "post", "put", "patch", "delete")]


@pytest.fixture(scope="module")
def served_schema(server):
    """The schema the daemon serves, shrunk so valid examples stay cheap, valid models named."""
    doc = httpx.get(f"{server.base_url}/openapi.json", timeout=30).json()
    components = doc["components"]["schemas"]
    for name, model in MODELS.items():  # valid examples name a served model, so they reach the engines
        components[name]["properties"]["model"] = {"type": "string", "enum": [model]}
    return schemathesis.openapi.from_dict(small(doc))


# Hypothesis drives schemathesis's strategies directly: its pytest integration
# (schemathesis.pytest.from_fixture) does not run under pytest 9.
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
@pytest.mark.parametrize("label", operations())
def test_fuzzed_requests_get_no_5xx(server, served_schema, label, mode):
    found = [r.ok() for r in served_schema.get_all_operations() if r.ok().label == label]
    assert found, f"{label} is not in the served /openapi.json"
    operation = found[0]

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case):
        check(case, server.base_url)

    try:
        fuzz()
    except Unsatisfiable:  # an operation with no inputs has no invalid example
        assert mode is GenerationMode.NEGATIVE, operation.label


def test_daemon_still_serves_after_fuzzing(server):
    # Background runs the fuzzer started finish on their own (their answers are a few tokens).
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and metric_value(server.metrics(), "headrace_llm_contexts", model="smollm2"):
        time.sleep(0.2)
    ready = httpx.get(f"{server.base_url}/ready", timeout=30)
    assert ready.status_code == 200 and ready.json()["ready"], ready.text
    r = httpx.post(f"{server.base_url}/v1/chat/completions", headers=HEADERS, timeout=120,
                   json={"model": "smollm2", "messages": [{"role": "user", "content": "Say hello."}],
                         "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
