"""Read request bodies safely and validate them with the models of ``openai_schemas`` and ``headrace_schemas``.

Every field a route does not support is refused by name with a 400, never
silently ignored (but for the few that change nothing here, which the schemas
declare as accepted and ignored, as vLLM does); every client mistake is a 4xx
with OpenAI's error envelope.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import anyio
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from headrace.daemon.errors import APIError, bad_request
from headrace.daemon.openai_schemas import NEUTRAL, ChatCompletionRequest, CompletionRequest, Sampling
from headrace.plugins.protocols import OutputConstraint, SamplingParams
from headrace.text import is_unicode

# No route needs deeper JSON; deeper nesting is refused before anything walks it recursively.
MAX_JSON_DEPTH = 32
# Bodies (and texts) past this size are parsed (tokenized) on a worker thread, so one
# megabyte-sized request does not stall every other connection's handling.
OFF_LOOP_BYTES = 64 * 1024

Model = TypeVar("Model", bound=BaseModel)


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object; 413 past ``limit`` bytes, 400 when not a clean JSON object."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")
    if len(body) > OFF_LOOP_BYTES:
        return await anyio.to_thread.run_sync(parse_json, bytes(body))
    return parse_json(bytes(body))


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(body: bytes) -> dict[str, Any]:
    """Parse and vet a body: an object, at most MAX_JSON_DEPTH deep, every string valid Unicode."""
    try:
        data = json.loads(body, parse_constant=_no_constants)
    except json.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except UnicodeDecodeError:
        raise bad_request("request body is not valid UTF-8", code="invalid_json") from None
    except RecursionError:
        raise bad_request(f"request body is nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") from None
    except ValueError as exc:  # NaN/Infinity, or an integer with thousands of digits
        message = str(exc) if "not valid JSON" in str(exc) else "a number in the body is too large"
        raise bad_request(f"request body is not valid JSON: {message}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    _vet(data)
    return data


def _vet(data: Any) -> None:
    """Refuse deep nesting and lone surrogates (``"\\ud800"`` parses, but no model or store can encode it)."""
    stack: list[tuple[Any, str, int]] = [(data, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"request body is nested deeper than {MAX_JSON_DEPTH} levels", param=path or None,
                              code="invalid_json")
        if isinstance(value, dict):
            for key, item in value.items():
                where = f"{path}.{key}" if path else key
                if not is_unicode(key):
                    raise bad_request("a key in the body is not valid Unicode (a lone surrogate)",
                                      param=path or None, code="invalid_json")
                stack.append((item, where, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))
        elif isinstance(value, str) and not is_unicode(value):
            raise bad_request(f"'{path}' is not valid Unicode (it holds a lone surrogate)", param=path,
                              code="invalid_value")


def validate(model: type[Model], body: dict[str, Any]) -> Model:
    """``body`` as ``model``; the first problem becomes a 400 naming its field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _error(exc) from None


# Union members and wrappers pydantic puts in an error's location; they are not field names.
def _is_tag(part: str) -> bool:
    return any(c in part for c in "[]-") or part[:1].isupper() or part in {"str", "int", "float", "bool", "list",
                                                                           "dict", "none"}


def param_of(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_tag(str(part)):
            out += f".{part}" if out else str(part)
    return out


def _error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False, include_input=False)
    # A union reports one error per member; the deepest is the member the client meant.
    deepest = max(errors, key=lambda e: len([p for p in e["loc"] if isinstance(p, int) or not _is_tag(p)]))
    param = param_of(deepest["loc"])
    same = [e for e in errors if param_of(e["loc"]) == param]
    top = param.split(".")[0].split("[")[0]
    if any(e["type"] == "extra_forbidden" for e in same):
        return bad_request(f"'{param}' is not supported by this server", param=param, code="unsupported_parameter")
    if top in NEUTRAL and param == top:
        return bad_request(f"'{param}' is not supported by this server (only {json.dumps(NEUTRAL[top])} is accepted)",
                           param=param, code="unsupported_parameter")
    missing = all(e["type"] == "missing" for e in same)
    messages = list(dict.fromkeys(e["msg"] for e in same))
    code = "missing_required_parameter" if missing else FIELD_CODES.get(param, "invalid_value")
    return bad_request(f"'{param}': {' or '.join(messages)}" if param else "; ".join(messages), param=param or None,
                       code=code)


# Fields whose every problem has a code of its own (a client tells them from any other bad value).
FIELD_CODES = {"cache_salt": "invalid_cache_salt"}


@dataclass(frozen=True)
class StreamSpec:
    stream: bool
    include_usage: bool


def stream_spec(body: Sampling) -> StreamSpec:
    if body.stream_options is not None and not body.stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    return StreamSpec(bool(body.stream), bool(body.stream_options and body.stream_options.include_usage))


def logprobs(body: ChatCompletionRequest | CompletionRequest) -> int | None:
    """How many alternatives each token's log-probability comes with; None: no log-probabilities."""
    if isinstance(body, CompletionRequest):
        return body.logprobs
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def sampling(body: ChatCompletionRequest | CompletionRequest, default_max_tokens: int,
             constraint: OutputConstraint | None = None) -> SamplingParams:
    # max_completion_tokens is OpenAI's newer name; on /v1/completions too it is max_tokens' alias.
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    min_tokens = body.min_tokens or 0
    if max_tokens is not None and min_tokens > max_tokens:
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        raise bad_request(f"'min_tokens' ({min_tokens}) is more than '{param}' ({max_tokens})", param="min_tokens")
    stop = body.stop
    stops = (stop,) if isinstance(stop, str) and stop else tuple(stop) if isinstance(stop, list) else ()
    return SamplingParams(
        # No max_tokens given: the default, or min_tokens where that is more (vLLM's default is the context).
        max_tokens=max_tokens or max(default_max_tokens, min_tokens),
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        seed=body.seed,
        stop=stops,
        logprobs=logprobs(body),
        constraint=constraint,
        presence_penalty=float(body.presence_penalty or 0),
        frequency_penalty=float(body.frequency_penalty or 0),
        repetition_penalty=1.0 if body.repetition_penalty is None else float(body.repetition_penalty),
        top_k=body.top_k or 0,
        min_p=float(body.min_p or 0),
        logit_bias={int(token): float(bias) for token, bias in (body.logit_bias or {}).items()},
        min_tokens=min_tokens,
        ignore_eos=bool(body.ignore_eos),
        stop_token_ids=tuple(body.stop_token_ids or ()),
    )


def sampling_token_ids(body: Sampling) -> list[tuple[str, int]]:
    """(param, token id) of every token id the body's sampling settings name, for the route to check against
    the model's vocabulary (``logit_bias`` keys, ``stop_token_ids``)."""
    return ([(f"logit_bias.{key}", int(key)) for key in body.logit_bias or {}]
            + [(f"stop_token_ids[{i}]", token) for i, token in enumerate(body.stop_token_ids or ())])


def completion_prompts(body: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts: each a text or a list of token ids."""
    prompt = body.prompt
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


async def off_loop_if_large(size: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, on a worker thread when its input is large (tokenizing megabytes takes seconds)."""
    if size > OFF_LOOP_BYTES:
        return await anyio.to_thread.run_sync(fn, *args)
    return fn(*args)
