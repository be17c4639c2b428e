"""Parse and validate OpenAI-style request bodies into plain values.

Every field a route does not support is refused by name with a 400, never
silently ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from starlette.requests import Request

from headrace.daemon.errors import APIError, bad_request
from headrace.plugins.protocols import SamplingParams

# Fields accepted only with the value that means "off" (what OpenAI's SDKs may send by default).
NEUTRAL = {
    "n": 1,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logprobs": False,
    "parallel_tool_calls": None,
    "echo": False,
    "best_of": 1,
}
CHAT_FIELDS = {"model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens",
               "temperature", "top_p", "seed", "stop", "user", "metadata", "store"}
COMPLETION_FIELDS = {"model", "prompt", "stream", "stream_options", "max_tokens", "temperature", "top_p",
                     "seed", "stop", "user"}


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object; 413 past ``limit`` bytes, 400 when not a JSON object."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return data


def check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    for key, value in body.items():
        if key in allowed:
            continue
        if key in NEUTRAL and value in (NEUTRAL[key], None):
            continue
        if key in NEUTRAL:
            raise bad_request(f"'{key}'={value!r} is not supported by this server", param=key, code="unsupported_parameter")
        raise bad_request(f"'{key}' is not supported by this server", param=key, code="unsupported_parameter")


def field(body: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = None,
          check: Callable[[Any], bool] | None = None, hint: str = "") -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok or (check is not None and not check(value)):
        raise bad_request(f"'{key}' must be {hint or ' or '.join(k.__name__ for k in kinds)}, got {value!r}", param=key)
    return value


def model_name(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string", param="model", code="missing_required_parameter")
    return model


@dataclass(frozen=True)
class StreamSpec:
    stream: bool
    include_usage: bool


def stream_spec(body: dict[str, Any]) -> StreamSpec:
    stream = field(body, "stream", bool, False)
    options = field(body, "stream_options", dict, {})
    if options and not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    for key in options:
        if key != "include_usage":
            raise bad_request(f"'stream_options.{key}' is not supported", param=f"stream_options.{key}",
                              code="unsupported_parameter")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise bad_request("'stream_options.include_usage' must be a boolean", param="stream_options.include_usage")
    return StreamSpec(stream, include)


def sampling(body: dict[str, Any], default_max_tokens: int, *, chat: bool) -> SamplingParams:
    max_tokens = field(body, "max_tokens", int, None, lambda v: v >= 1, "an integer >= 1")
    if chat:
        max_completion = field(body, "max_completion_tokens", int, None, lambda v: v >= 1, "an integer >= 1")
        max_tokens = max_completion if max_completion is not None else max_tokens
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop):
        stops = tuple(stop)
    else:
        raise bad_request("'stop' must be a string or a list of at most 4 non-empty strings", param="stop")
    return SamplingParams(
        max_tokens=max_tokens or default_max_tokens,
        temperature=float(field(body, "temperature", float, 1.0, lambda v: 0 <= v <= 2, "a number in [0, 2]")),
        top_p=float(field(body, "top_p", float, 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")),
        seed=field(body, "seed", int),
        stop=stops,
    )


def chat_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", param="messages",
                          code="missing_required_parameter" if messages is None else "invalid_value")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"'{where}' must be an object", param=where)
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise bad_request(f"'{where}.role' must be system, developer, user or assistant, got {role!r}",
                              param=f"{where}.role")
        for key in m:
            if key not in ("role", "content", "name"):
                raise bad_request(f"'{where}.{key}' is not supported by this server", param=f"{where}.{key}",
                                  code="unsupported_parameter")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise bad_request(f"'{where}.content[{j}]' must be a text part; only text is supported",
                                      param=f"{where}.content[{j}]", code="unsupported_parameter")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise bad_request(f"'{where}.content' must be a string or a list of text parts", param=f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def completion_prompt(body: dict[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise bad_request("'prompt' must be a string, a list of one string, or a list of token ids", param="prompt")
