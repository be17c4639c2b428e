"""Liveness, readiness and the drain on SIGTERM, shared by the app's routes and the CLI's server.

- Alive: the lifespan's task groups are running and the engine pool says its loops are.
  ``/health`` answers 503 otherwise, and the systemd watchdog stops being pinged.
- Under systemd's watchdog, every tick also asks each engine's worker for a heartbeat (the
  tick itself running shows the event loop is alive): an engine wedged in a forward pass
  stops the pings, so systemd restarts the daemon, and ``/health`` names it meanwhile.
- Draining: from the first SIGTERM/SIGINT on, ``/ready`` is 503 and new requests get 503
  (probes still answer) while in-flight requests and runs get ``server.drain_seconds`` to
  finish; what is left then is cancelled. ``drained`` tells the server it may stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import anyio
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from headrace.daemon import systemd
from headrace.daemon.errors import APIError
from headrace.daemon.pool import EnginePool
from headrace.graph.executor import Run
from headrace.graph.service import WorkflowService

log = logging.getLogger(__name__)

# Probes answer during a drain (a load balancer polls /ready to take the replica out) and
# are not in-flight work the drain waits for.
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})
# Runs already started may still be listed, read and cancelled while draining: a client
# collects its background run's result there before the daemon exits.
RUN_PATHS = "/v1/runs"


@dataclass
class Health:
    alive: bool
    problems: dict[str, str] = field(default_factory=dict)


class Lifecycle:
    def __init__(self, pool: EnginePool, workflows: WorkflowService, drain_seconds: float) -> None:
        self.pool, self.workflows = pool, workflows
        self.drain_seconds = drain_seconds
        self.serving = False  # the lifespan's task groups are up (set by run)
        self.draining = False
        self.drained = False  # the drain is over: the server may close its listener and stop
        self.in_flight = 0  # HTTP requests being answered, probes excepted
        self._drain_asked: anyio.Event | None = None  # events belong to a loop: made in run()
        self._idle: anyio.Event | None = None
        self.stalled: dict[str, str] = {}  # engines whose worker the watchdog found wedged at its last tick

    # ----- liveness and readiness ----------------------------------------------------

    def health(self) -> Health:
        """Alive unless a loop is dead; problems also name what a restart would not cure (a model that
        failed to load), which readiness reports but liveness does not act on."""
        alive, problems = self.serving, {}
        if not self.serving:
            problems["daemon"] = "the daemon's task groups are not running"
        pool_state = self.pool.health()
        problems.update(pool_state.problems)
        problems.update(self.stalled)
        return Health(alive=alive and pool_state.alive and not self.stalled, problems=problems)

    @property
    def ready(self) -> bool:
        return self.pool.ready and not self.draining and self.serving

    # ----- the lifespan's task ---------------------------------------------------------

    async def run(self, cancel_in_flight: Callable[[], None], *,
                  task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Watch the daemon until cancelled: ping systemd's watchdog, and drain once asked.

        ``cancel_in_flight`` cancels every run, plain request and session's work: called only when
        the drain time runs out.
        """
        self._drain_asked = anyio.Event()
        if self.draining:  # a signal came before the lifespan started
            self._drain_asked.set()
        try:
            self.serving = True
            async with anyio.create_task_group() as tg:
                interval = systemd.watchdog_interval()
                if interval is not None:
                    tg.start_soon(self._ping_watchdog, interval)
                task_status.started()
                await self._drain_asked.wait()
                await self._drain(cancel_in_flight)
                await anyio.sleep_forever()  # alive (probes, watchdog) until the server ends the lifespan
        finally:
            self.serving = False

    async def _ping_watchdog(self, interval: float) -> None:
        """Every ``interval`` (half the watchdog's timeout) ping systemd, but only while truly alive.

        Each engine's worker gets ``interval`` to answer; one that does not withholds this tick's
        ping, and a worker wedged for as long as the watchdog's timeout lets systemd restart us.
        """
        withheld: dict[str, str] = {}
        while True:
            tick = anyio.current_time()
            self.stalled = await self.pool.unresponsive(within=interval)
            state = self.health()
            if state.alive:
                if withheld:
                    log.warning("watchdog: alive again, pinging systemd")
                systemd.notify("WATCHDOG=1")
                withheld = {}
            else:
                if state.problems != withheld:
                    log.error("watchdog: not pinging systemd: %s",
                              "; ".join(f"{name}: {why}" for name, why in state.problems.items()))
                withheld = state.problems
            await anyio.sleep(max(0.0, interval - (anyio.current_time() - tick)))

    # ----- drain -----------------------------------------------------------------------

    def request_drain(self) -> None:
        """Start draining; call on the event loop (a signal handler goes through the loop)."""
        if self.draining:
            return
        self.draining = True
        if self._drain_asked is not None:
            self._drain_asked.set()

    def in_flight_counts(self) -> dict[str, int]:
        return {"requests": self.in_flight, "runs": len(self.active_runs())}

    def active_runs(self) -> list[Run]:
        return [run for run in list(self.workflows.runs.values()) if run.status in ("queued", "running")]

    async def _drain(self, cancel_in_flight: Callable[[], None]) -> None:
        systemd.notify("STOPPING=1")
        systemd.notify(f"STATUS=draining: {self.in_flight} request(s) and {len(self.active_runs())} run(s) in flight")
        log.info("draining: %d request(s) and %d run(s) in flight get up to %gs to finish; new requests get 503",
                 self.in_flight, len(self.active_runs()), self.drain_seconds)
        with anyio.move_on_after(self.drain_seconds):
            await self._wait_idle()
        requests_left, runs_left = self.in_flight, len(self.active_runs())
        if requests_left or runs_left:
            log.warning("drain time (%gs) is over: cancelling %d request(s) and %d run(s) still in flight",
                        self.drain_seconds, requests_left, runs_left)
            cancel_in_flight()
        else:
            log.info("drained: nothing in flight")
        self.drained = True

    async def _wait_idle(self) -> None:
        while True:
            runs = self.active_runs()
            if runs:
                await runs[0].done.wait()
            elif self.in_flight:
                self._idle = anyio.Event()
                await self._idle.wait()
            else:
                return

    def _request_started(self) -> None:
        self.in_flight += 1

    def _request_ended(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()


class DrainMiddleware:
    """Refuses new work while draining (503, code ``draining``) and counts what is in flight."""

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle) -> None:
        self.app, self.lifecycle = app, lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBE_PATHS:
            await self.app(scope, receive, send)
            return
        if self.lifecycle.draining and not scope["path"].startswith(RUN_PATHS):
            response = APIError(503, "the daemon is shutting down and takes no new requests; retry elsewhere",
                                code="draining").response()
            response.headers["Connection"] = "close"  # the client should reconnect to another replica
            await response(scope, receive, send)
            return
        self.lifecycle._request_started()
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle._request_ended()


class DrainingServer(uvicorn.Server):
    """uvicorn's server, but the first SIGTERM/SIGINT drains instead of closing the listener.

    uvicorn stops accepting connections on the first signal and re-raises it after
    shutdown (exit 143). Here the listener keeps serving (new requests get 503) until the
    lifecycle has drained, then the server stops and the process exits 0. A second signal
    stops at once (exit 128 + its number).
    """

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.exit_status = 0

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        handled = (signal.SIGINT, signal.SIGTERM)
        for sig in handled:
            # add_signal_handler runs the handler as a loop callback, so it may touch anyio state.
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in handled:
                loop.remove_signal_handler(sig)

    def handle_exit(self, sig: int, frame: Any) -> None:
        name = signal.Signals(sig).name
        if self.lifecycle.draining:
            log.warning("%s during the drain: stopping now", name)
            self.exit_status = 128 + sig
            self.should_exit = self.force_exit = True
            return
        log.info("%s: draining (up to %gs)", name, self.lifecycle.drain_seconds)
        self.lifecycle.request_drain()

    async def on_tick(self, counter: int) -> bool:
        return await super().on_tick(counter) or self.lifecycle.drained
