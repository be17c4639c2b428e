"""What importing the package does to the process before any engine loads."""

import os
import subprocess
import sys


def _openmp_as_loaded(env: dict[str, str]) -> dict[str, str]:
    """What libgomp itself read when llama.cpp and torch loaded after ``import headrace`` (OMP_DISPLAY_ENV
    makes it print its settings), and whether torch had loaded before the import returned."""
    code = ("import sys, headrace; print('torch' in sys.modules, flush=True); "
            "import llama_cpp, torch; torch.ones(8) @ torch.ones(8)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**env, "OMP_DISPLAY_ENV": "VERBOSE"})
    assert proc.returncode == 0, proc.stderr
    shown = dict(line.strip().split(" = ", 1) for line in (proc.stdout + proc.stderr).splitlines()
                 if line.strip().startswith(("OMP_WAIT_POLICY =", "GOMP_SPINCOUNT =")))
    return {"torch before": proc.stdout.splitlines()[0], **{k: v.strip("'") for k, v in shown.items()}}


def _without_openmp_settings() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}


def test_importing_headrace_gives_openmp_waiters_a_bounded_spin_before_any_engine_loads():
    # llama.cpp's barriers with sleeping waiters cost its decode up to a fifth (docs/engines.md); ACTIVE
    # alone would spin for minutes after the last step.
    got = _openmp_as_loaded(_without_openmp_settings())
    assert got == {"torch before": "False", "OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}


def test_an_operators_own_openmp_wait_policy_wins_and_keeps_its_own_spin():
    got = _openmp_as_loaded({**_without_openmp_settings(), "OMP_WAIT_POLICY": "PASSIVE"})
    # PASSIVE's own spin count is 0; a spin count of ours would have overridden it.
    assert got == {"torch before": "False", "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}
