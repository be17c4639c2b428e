"""The harness's daemon processes die with the process that started them (a crashed test worker or benchmark
leaves none behind holding memory and cores)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

STARTER = """
import subprocess, sys, time
from headrace.bench.client import dies_with_this_process
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         preexec_fn=dies_with_this_process() if sys.argv[1] == "1" else None)
print(child.pid, flush=True)
time.sleep(60)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("tied", [True, False])
def test_a_started_daemon_ends_when_its_starter_is_killed(tied):
    starter = subprocess.Popen([sys.executable, "-c", STARTER, "1" if tied else "0"], stdout=subprocess.PIPE,
                               text=True)
    child = int(starter.stdout.readline())
    os.kill(starter.pid, signal.SIGKILL)
    starter.wait()
    deadline = time.monotonic() + (10 if tied else 1)  # untied: a second shows it outlives its starter
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert alive(child) is not tied  # untied: the orphan lives on, which is what the preexec_fn prevents
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)
