"""PATCH /v1/engines/{engine}: engine settings an operator (or a benchmark) changes on a live daemon.

What vLLM offers as ``/reset_prefix_cache`` and a restart with another
``--scheduling-policy``, without a restart: the LLM scheduling policy, and
automatic prefix caching on or off, its token budget (and its pins'), and the
bound on runs an LLM engine serves at once. Each applies to requests from then on; the
benchmark uses them to compare modes on the same daemon and engines.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from headrace.batching.llm import LLMScheduler
from headrace.daemon import bodies as rq
from headrace.daemon.errors import APIError, bad_request
from headrace.daemon.headrace_schemas import EngineSettingsRequest
from headrace.daemon.services import daemon
from headrace.plugins.engines.llm.front import EngineError
from headrace.plugins.protocols import PinsPrefixes, PrefixCaching, SizesPrefixCache


async def update_engine(request: Request) -> Response:
    raw = await rq.read_json(request, daemon(request).config.server.max_body_bytes)
    body = rq.validate(EngineSettingsRequest, raw)
    pool = daemon(request).pool
    name = request.path_params["engine"]
    slot = pool.slots.get(name)
    if slot is None:
        raise APIError(404, f"the engine '{name}' does not exist", param="engine", code="model_not_found")
    if slot.state != "ready":
        raise APIError(503, f"the engine '{name}' is {slot.state}, not ready", code="model_not_ready")
    is_llm = isinstance(slot.scheduler, LLMScheduler)
    if body.llm_policy is not None:
        if not is_llm:
            raise bad_request(f"'{name}' is an engine of kind '{slot.engine.kind}'; only LLM engines have an LLM "
                              "policy", param="llm_policy", code="model_not_supported")
        known = sorted(daemon(request).registry.llm_policies)
        if body.llm_policy not in known:
            raise bad_request(f"unknown LLM policy '{body.llm_policy}'; known: {known}", param="llm_policy")
    if body.max_runs is not None and not is_llm:
        raise bad_request(f"'{name}' is an engine of kind '{slot.engine.kind}'; only LLM engines bound the runs "
                          "they serve", param="max_runs", code="model_not_supported")
    if body.prefix_caching is not None and not isinstance(slot.engine, PrefixCaching):
        raise bad_request(f"the engine '{name}' has no prefix cache to switch", param="prefix_caching",
                          code="model_not_supported")
    if body.retention is not None and not isinstance(slot.engine, PinsPrefixes):
        raise bad_request(f"the engine '{name}' has no prefix-cache pins to retain programs' contexts with",
                          param="retention", code="model_not_supported")
    budget = cache_budget(slot, name, body.prefix_cache_tokens, body.prefix_cache_pin_tokens)
    # Checked first, then applied: a refused body changes nothing.
    if body.llm_policy is not None:
        pool.set_llm_policy(name, body.llm_policy)
    if body.max_runs is not None:
        slot.scheduler.run_gate.limit = body.max_runs
    if budget is not None:
        async with slot.scheduler.residency.hold():
            await slot.engine.set_prefix_cache_budget(*budget)
    if body.prefix_caching is not None:
        try:
            async with slot.scheduler.residency.hold():  # an engine unloaded under the budget loads first
                await slot.engine.set_prefix_caching(body.prefix_caching)
        except EngineError as exc:
            raise bad_request(str(exc), param="prefix_caching", code="model_not_supported") from None
    if body.retention is not None:
        slot.retention = body.retention  # pins already made run out at their TTL
    return JSONResponse(settings_of(slot, is_llm))


def cache_budget(slot: Any, name: str, tokens: int | None, pin_tokens: int | None) -> tuple[int, int] | None:
    """The prefix cache's new (budget, pin budget) a body asks for, checked; None: it asks for none. Pins given no
    budget of their own keep their share of the cache."""
    if tokens is None and pin_tokens is None:
        return None
    param = "prefix_cache_tokens" if tokens is not None else "prefix_cache_pin_tokens"
    old = slot.engine.prefix_cache_budget() if isinstance(slot.engine, SizesPrefixCache) else (0, 0)
    if old[0] <= 0:
        raise bad_request(f"the engine '{name}' has no prefix cache whose budget can be set", param=param,
                          code="model_not_supported")
    tokens = old[0] if tokens is None else tokens
    pin_tokens = old[1] * tokens // old[0] if pin_tokens is None else pin_tokens
    if pin_tokens > tokens:
        raise bad_request(f"prefix_cache_pin_tokens ({pin_tokens}) may not exceed prefix_cache_tokens ({tokens})",
                          param="prefix_cache_pin_tokens")
    return tokens, pin_tokens


def settings_of(slot: Any, is_llm: bool) -> dict[str, Any]:
    engine = slot.engine
    budget = engine.prefix_cache_budget() if isinstance(engine, SizesPrefixCache) else (0, 0)
    return {"id": slot.name, "object": "engine.settings", "kind": engine.kind,
            "llm_policy": slot.scheduler.policy.name if is_llm else None,
            "max_runs": slot.scheduler.run_gate.limit if is_llm else None,
            "prefix_caching": engine.prefix_caching_enabled() if isinstance(engine, PrefixCaching) else None,
            "retention": slot.retention if isinstance(engine, PinsPrefixes) else None,
            "prefix_cache_tokens": budget[0] or None, "prefix_cache_pin_tokens": budget[1] if budget[0] else None}
