"""The workflow REST API: list workflows, start runs (plain, SSE, background), follow, inspect and cancel them."""

from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from headrace.daemon import bodies as rq
from headrace.daemon.errors import APIError, bad_request
from headrace.daemon.headrace_schemas import RunEventsQuery, RunListQuery, RunRequest
from headrace.daemon.cache_partition import cache_partition
from headrace.daemon.ownership import caller, mine, owns
from headrace.daemon.services import daemon
from headrace.graph.collection_refs import UnknownCollection
from headrace.graph.events import EventReader, RunEvent
from headrace.graph.executor import Run
from headrace.graph.run_history import graph_and_dot, timeline, timeline_and_passes
from headrace.graph.service import WorkflowService, seconds
from headrace.graph.workflow import UnknownWorkflow, WorkflowInputError


def _service(request: Request) -> WorkflowService:
    if not daemon(request).pool.ready:
        raise APIError(503, "the engines are still loading", code="not_ready")
    return daemon(request).workflows


def run_json(run: Run) -> dict[str, Any]:
    nodes, passes = timeline_and_passes(run)
    return {
        "id": run.id, "object": "workflow.run", "workflow": run.workflow, "status": run.status,
        "result": _jsonable(run.result), "error": run.error, "created": int(run.created),
        "seconds": round(seconds(run), 6), "nodes": nodes,
        "passes": passes,
        "details_dropped": run.details_dropped,
    }


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def _run(request: Request) -> Run:
    """The run named in the path; another key's run is 404, as a missing one, so ids reveal nothing."""
    run = mine(request, daemon(request).workflows.runs.get(request.path_params["run_id"]))
    if run is None:
        raise APIError(404, f"no run {request.path_params['run_id']!r}", param="run_id", code="run_not_found")
    return run


def _details(run: Run, what: str) -> Run:
    """``run``, if it still holds its details: past the run history's byte budget an old finished run keeps only
    its summary and timeline ([workflows] run_history_mib), and what needs the rest is gone for good."""
    if run.details_dropped:
        raise APIError(410, f"run {run.id!r} is kept as a summary only: its {what} went to keep the run history within "
                       "[workflows] run_history_mib", param="run_id", code="run_details_dropped")
    return run


async def list_workflows(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": daemon(request).workflows.describe()})


async def create_run(request: Request) -> Response:
    service = _service(request)
    raw = await rq.read_json(request, daemon(request).config.server.max_body_bytes)
    body = rq.validate(RunRequest, raw)
    stream, background = bool(body.stream), bool(body.background)
    try:
        # Off the event loop: a megabyte question is tokenized, and documents chunked, while building.
        run = await service.prepare_off_loop(request.path_params["name"], body.inputs, body.config, caller(request))
    except UnknownWorkflow as exc:
        raise APIError(404, str(exc), param="name", code="workflow_not_found") from None
    except UnknownCollection as exc:
        raise APIError(404, str(exc), param="inputs.collection", code="collection_not_found") from None
    except WorkflowInputError as exc:
        raise bad_request(str(exc), param=exc.field) from None
    run.cache_partition = cache_partition(request)  # its LLM calls share cached KV only with its key's requests
    events = run.events.follow() if stream else None  # held from now: no event is missed before the first read
    service.start(run)
    if background and not stream:
        return JSONResponse(run_json(run), status_code=202, headers={"Location": f"/v1/runs/{run.id}"})
    if stream:
        return StreamingResponse(_events(request, run, events, background), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    await _wait_or_cancel(request, run, background)
    return JSONResponse(run_json(run))


async def _wait_or_cancel(request: Request, run: Run, background: bool) -> None:
    """Wait for the run; a client that goes away first cancels it (unless it asked for background)."""
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            if not background:
                run.cancel_scope.cancel()

        tg.start_soon(watch)
        await run.done.wait()
        tg.cancel_scope.cancel()


async def _events(request: Request, run: Run, events: EventReader, background: bool) -> AsyncIterator[str]:
    """The run's events as SSE. Only a client that leaves cancels its run (unless it asked for
    background): one that reads slowly falls behind and is told what it missed (``events.dropped``)."""
    try:
        async for line in _sse_lines(events):
            yield line
    finally:
        # The stream ended: either the run finished, or the client left (the generator is closed).
        if not run.done.is_set() and not background:
            run.cancel_scope.cancel()


async def _sse_lines(events: EventReader) -> AsyncIterator[str]:
    async with events:
        async for event in events:
            yield _sse(event)


def _sse(event: RunEvent) -> str:
    seq = f"id: {event.seq}\n" if event.seq >= 0 else ""  # a dropped-events notice has no place to resume from
    return f"{seq}event: {event.name}\ndata: {json.dumps(_jsonable(event.body))}\n\n"


async def run_events(request: Request) -> Response:
    """Follow a run's events as SSE, from the oldest the run still holds, or after ``Last-Event-ID`` (a
    reconnecting EventSource sends it) or ``?after=``. Reading never cancels the run."""
    run = _details(_run(request), "events")
    query = rq.validate(RunEventsQuery, dict(request.query_params))
    after = query.after
    if after is None and "last-event-id" in request.headers:
        try:
            after = int(request.headers["last-event-id"])
        except ValueError:
            raise bad_request("Last-Event-ID must be an event id (an integer) this stream sent",
                              param="Last-Event-ID") from None
    return StreamingResponse(_sse_lines(run.events.follow(after)), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def list_runs(request: Request) -> Response:
    """The caller's own runs (those its API key created), a page at a time, as OpenAI lists."""
    query = rq.validate(RunListQuery, dict(request.query_params))
    who = caller(request)
    runs = [run for run in list(daemon(request).workflows.runs.values()) if owns(run.owner, who)]  # oldest first
    if query.order == "desc":
        runs.reverse()
    if query.after is not None:
        ids = [run.id for run in runs]
        if query.after not in ids:  # another key's run is as unknown as a missing one
            raise APIError(404, f"no run {query.after!r} to list after", param="after", code="run_not_found")
        runs = runs[ids.index(query.after) + 1:]
    page = runs[:query.limit]
    return JSONResponse({"object": "list", "data": [run_json(run) for run in page],
                         "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None,
                         "has_more": len(runs) > len(page)})


async def get_run(request: Request) -> Response:
    return JSONResponse(run_json(_run(request)))


async def cancel_run(request: Request) -> Response:
    run = _run(request)
    run.cancel_scope.cancel()
    with anyio.move_on_after(10):
        await run.done.wait()
    return JSONResponse(run_json(run))


def run_timeline(request: Request, run: Run) -> dict[str, Any]:
    """The run's primitives and the engine batches computed meanwhile, in seconds from its start."""
    end = run.finished if run.finished is not None else time.monotonic()
    busy = daemon(request).pool.metrics.busy_between(run.started, end)
    return {"run": run.id, "workflow": run.workflow, "status": run.status, "seconds": round(end - run.started, 6),
            "nodes": timeline(run), "engines": [b.to_json(run.started) for b in busy]}


async def get_timeline(request: Request) -> Response:
    return JSONResponse(run_timeline(request, _run(request)))


async def get_timeline_png(request: Request) -> Response:
    from headrace.daemon.timeline_plot import timeline_png  # matplotlib loads on first use, not at startup

    data = run_timeline(request, _run(request))
    png = await anyio.to_thread.run_sync(timeline_png, data)  # rendering takes ~100 ms of CPU: off the event loop
    return Response(png, media_type="image/png")


async def run_graph(request: Request) -> Response:
    run = _details(_run(request), "graph")
    graph, dot = graph_and_dot(run)
    if request.query_params.get("format") == "dot":
        return Response(dot, media_type="text/vnd.graphviz")
    return JSONResponse({"run": run.id, "graph": graph, "dot": dot})
