"""scripts/bench/step_overhead.py runs end to end on a few short requests and times what it says: every decode
step of the engine and of the bare loop goes through its llama_decode clock (a step it missed would count as
Python, and the figure would mean nothing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench" / "step_overhead.py"


@pytest.mark.parametrize("streams", [1, 2])
def test_a_short_run_times_every_decode_step(tmp_path, streams):
    out = tmp_path / "steps.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--requests", "2", "--tokens", "12", "--streams", str(streams),
                           "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["streams"] == streams and len(res["engine_us_per_step"]) == 2
    # From the first token to the last of 12 (ignore_eos): 11 decode steps, all streams in each; a second
    # stream's prompt may reach the engine a step after the first's (then its prefill and last step count too).
    assert all(11 <= steps <= 11 + 2 * (streams - 1) for steps in res["engine_steps"]), res["engine_steps"]
    assert all(0 < us < 1e5 for us in res["engine_us_per_step"])
    if streams == 1:
        assert res["direct_steps"] == [11, 11] and all(0 < us < 1e5 for us in res["direct_us_per_step"])
    else:
        assert res["direct_median_us"] is None  # the bare loop is one stream only
    assert "outside llama_decode" in proc.stdout
