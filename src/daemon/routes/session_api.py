"""Parrot's semantic-variable API: /v1/sessions, their variables and their calls.

A session belongs to the API key that opened it (another key's session is 404, as a
missing one); the work is done by ``headrace.graph.sessions``: these routes validate,
translate its errors into OpenAI's envelope, and shape the answers.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from headrace.daemon import bodies as rq
from headrace.daemon.errors import APIError
from headrace.daemon.headrace_schemas import (CreateSessionRequest, CreateVariableRequest, OutputSampling,
                                              SemanticCallRequest, SetVariableRequest, VariableQuery)
from headrace.daemon.cache_partition import cache_partition
from headrace.daemon.ownership import caller, mine
from headrace.daemon.services import daemon
from headrace.graph.sessions import Call, Session, SessionClosed, SessionError
from headrace.plugins.protocols import SamplingParams

REQUEST_TIMEOUT = 408  # the value was not ready within the request's timeout: ask again
FAILED_DEPENDENCY = 424  # the variable's producer failed


def _session(request: Request) -> Session:
    session_id = request.path_params["session_id"]
    session = mine(request, daemon(request).sessions.get(session_id))
    if session is None:
        raise APIError(404, f"no session {session_id!r}", param="session_id", code="session_not_found")
    return session


def _error(exc: SessionError) -> APIError:
    return APIError(exc.status, str(exc), param=exc.field, code=exc.code)


def variable_json(session: Session, name: str) -> dict[str, Any]:
    variable = session.variables[name]
    state, value = session.state(name)
    return {"object": "session.variable", "name": name, "state": state,
            "value": value if state == "ready" else None, "error": value if state == "failed" else None,
            "producer": variable.producer, "criteria": variable.criteria}


def call_json(session: Session, call: Call) -> dict[str, Any]:
    status, error = session.call_status(call)
    return {"id": call.id, "object": "session.call", "status": status, "inputs": list(call.inputs),
            "outputs": list(call.outputs), "objective": session.call_objective(call), "error": error,
            "created": int(call.created)}


def session_json(session: Session, idle_seconds: float) -> dict[str, Any]:
    return {"id": session.id, "object": "session", "created": int(session.created), "idle_seconds": idle_seconds,
            "variables": [variable_json(session, name) for name in session.variables],
            "calls": [call_json(session, call) for call in session.calls.values()]}


async def create_session(request: Request) -> Response:
    # The body may be left out: a session has no settings yet.
    empty = request.headers.get("content-length") == "0" or not ({"content-length", "transfer-encoding"}
                                                                & set(request.headers.keys()))
    raw = {} if empty else await rq.read_json(request, daemon(request).config.server.max_body_bytes)
    rq.validate(CreateSessionRequest, raw)
    manager = daemon(request).sessions
    session = manager.create(caller(request))
    # Before its run executes (started soon, after this handler's next await): its calls' cached KV is its key's.
    session.run.cache_partition = cache_partition(request)
    return JSONResponse(session_json(session, manager.idle_seconds))


async def get_session(request: Request) -> Response:
    session = _session(request)
    async with session.in_use():
        return JSONResponse(session_json(session, daemon(request).sessions.idle_seconds))


async def delete_session(request: Request) -> Response:
    session = _session(request)
    await daemon(request).sessions.close(session)
    return JSONResponse({"id": session.id, "object": "session.deleted", "deleted": True})


async def create_variable(request: Request) -> Response:
    return await _write_variable(request, CreateVariableRequest,
                                 lambda session, body: session.create_variable(body.name, body.value))


async def set_variable(request: Request) -> Response:
    return await _write_variable(request, SetVariableRequest, lambda session, body: session.set_variable(
        request.path_params["variable"], body.value))


async def _write_variable(request: Request, model: Any, write: Any) -> Response:
    """Read and validate the body, apply ``write(session, body)``, answer with the variable."""
    session = _session(request)
    async with session.in_use():
        raw = await rq.read_json(request, daemon(request).config.server.max_body_bytes)
        body = rq.validate(model, raw)
        try:
            variable = write(session, body)
        except SessionError as exc:
            raise _error(exc) from None
        return JSONResponse(variable_json(session, variable.name))


async def get_variable(request: Request) -> Response:
    session = _session(request)
    query = rq.validate(VariableQuery, dict(request.query_params))
    name = request.path_params["variable"]
    async with session.in_use():
        try:
            await session.wait(name, query.criteria, query.timeout)
        except SessionError as exc:
            raise _error(exc) from None
        except TimeoutError:
            raise APIError(REQUEST_TIMEOUT, f"variable {name!r} was not ready within {query.timeout:g} s",
                           param="timeout", code="variable_not_ready") from None
        except SessionClosed as exc:
            raise APIError(404, str(exc), param="session_id", code="session_not_found") from None
        body = variable_json(session, name)
    if body["state"] == "failed":
        raise APIError(FAILED_DEPENDENCY, f"variable {name!r} has no value: {body['error']}", param="variable",
                       code="variable_failed")
    return JSONResponse(body)


async def create_call(request: Request) -> Response:
    session = _session(request)
    async with session.in_use():
        raw = await rq.read_json(request, daemon(request).config.server.max_body_bytes)
        body = rq.validate(SemanticCallRequest, raw)
        manager = daemon(request).sessions
        try:
            engine = manager.llm_engine(body.model)
            call = session.add_call(body.template, {name: _sampling(s) for name, s in body.outputs.items()},
                                    _sampling(None), engine, body.system)
        except SessionError as exc:
            raise _error(exc) from None
        try:
            await session.submit(call)
        except SessionClosed as exc:
            raise APIError(404, str(exc), param="session_id", code="session_not_found") from None
        return JSONResponse(call_json(session, call))


def _sampling(spec: OutputSampling | None) -> SamplingParams:
    """An output's sampling; ``None``: the defaults (the request schema's, so they are written once)."""
    spec = spec if spec is not None else OutputSampling()
    return SamplingParams(max_tokens=spec.max_tokens, temperature=spec.temperature, top_p=spec.top_p,
                          seed=spec.seed, stop=tuple(spec.stop))

