"""What importing the package does to the process before any engine loads."""

import os
import subprocess
import sys


def _import_and_report(env: dict[str, str]) -> str:
    code = ("import sys, os, headrace; "
            "print('torch' in sys.modules, os.environ.get('OMP_WAIT_POLICY'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_importing_headrace_makes_openmp_waiters_sleep_before_torch_loads():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    # torch not yet loaded: libgomp will read the policy when an engine imports it.
    assert _import_and_report(env) == "False PASSIVE"


def test_an_operators_own_openmp_wait_policy_wins():
    env = {**os.environ, "OMP_WAIT_POLICY": "ACTIVE"}
    assert _import_and_report(env) == "False ACTIVE"
