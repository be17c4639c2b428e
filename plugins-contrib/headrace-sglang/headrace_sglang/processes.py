"""SGLang, process-wide: its engine class, its processes, and the settings made before it starts."""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import os
import signal
from functools import cache
from pathlib import Path
from typing import Any

log = logging.getLogger("headrace_sglang")

# SGLang's logging setup calls logging.basicConfig(force=True), which would replace the daemon's
# handlers; this configuration (SGLANG_LOGGING_CONFIG_PATH) changes nothing instead.
LOGGING_CONFIG = Path(__file__).with_name("sglang_logging.json")


@cache
def engine_class() -> type:
    """SGLang's Engine, its tokenizer manager reporting each batch of outputs (through the
    Engine's own hook for a custom tokenizer manager)."""
    from sglang.srt.entrypoints.engine import Engine, init_tokenizer_manager
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    class ObservedTokenizerManager(TokenizerManager):
        on_output_batch: Any = None  # set by the plugin once the engine runs

        def _handle_batch_output(self, recv_obj: Any, *args: Any, **kwargs: Any) -> Any:
            if self.on_output_batch is not None:
                self.on_output_batch(recv_obj.rids)
            # A coroutine in newer releases, which their caller awaits: returned as is.
            return super()._handle_batch_output(recv_obj, *args, **kwargs)

    def init_observed_tokenizer_manager(server_args: Any, port_args: Any) -> Any:
        return init_tokenizer_manager(server_args, port_args, TokenizerManagerClass=ObservedTokenizerManager)

    class HeadraceSGLangEngine(Engine):
        init_tokenizer_manager_func = staticmethod(init_observed_tokenizer_manager)

    return HeadraceSGLangEngine


def prepare_sglang_process() -> None:
    """Process-wide settings, made before SGLang starts (its processes inherit them)."""
    # SGLang's records in this process go through the daemon's logging (its level and format);
    # its own processes print warnings and errors to stderr.
    os.environ.setdefault("SGLANG_LOGGING_CONFIG_PATH", str(LOGGING_CONFIG))
    # Log-probabilities of the raw logits for next_token_logits, whatever else shares its batch.
    os.environ.setdefault("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")


def catch_sigquit(loop: asyncio.AbstractEventLoop, callback: Any) -> bool:
    """SGLang's processes signal SIGQUIT to their parent when they fail; by default that ends the
    daemon. Caught, it fails this engine. Only a loop on the main thread can catch it."""
    try:
        loop.add_signal_handler(signal.SIGQUIT, callback)
        return True
    except (RuntimeError, ValueError, NotImplementedError):
        log.warning("SIGQUIT is not caught (the event loop is not on the main thread): a failing SGLang "
                    "process will end this process")
        return False


def prompt_limit(manager: Any) -> int:
    """A prompt must be shorter than this: SGLang refuses longer ones (its context less what it keeps back)."""
    limit = int(manager.context_len) - int(getattr(manager, "num_reserved_tokens", 0) or 0)
    scheduler_limit = getattr(manager, "max_req_input_len", None)  # smaller when the KV pool is
    if scheduler_limit:
        limit = min(limit, int(scheduler_limit))
    return limit



def shut_down(engine: Any, processes: list[multiprocessing.Process]) -> None:
    """Stop SGLang's processes, and only them (``Engine.shutdown`` kills every child of this process)."""
    watchdog = getattr(engine.tokenizer_manager, "_subprocess_watchdog", None)
    if watchdog is not None:  # it would signal SIGQUIT for the processes stopped below
        try:
            watchdog.stop()
        except Exception:
            log.exception("stopping SGLang's process watchdog failed")
    stop_processes(processes)
    atexit.unregister(engine.shutdown)


def stop_processes(processes: list[multiprocessing.Process]) -> None:
    """Kill the processes and their descendants, as SGLang's own shutdown does, and reap them."""
    import psutil  # an SGLang dependency

    descendants: list[Any] = []
    for proc in processes:
        if proc.is_alive():
            try:
                descendants.extend(psutil.Process(proc.pid).children(recursive=True))
            except psutil.NoSuchProcess:
                pass
    for victim in descendants:
        try:
            victim.kill()
        except psutil.NoSuchProcess:
            pass
    # The direct children through multiprocessing, which reaps them (psutil reaping them would
    # leave their Process objects alive forever).
    for proc in processes:
        if proc.is_alive():
            proc.kill()
    for proc in processes:
        proc.join(timeout=60)
    psutil.wait_procs(descendants, timeout=60)

