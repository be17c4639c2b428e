"""scripts/bench/decode_profile.py runs end to end (--tiny) on the default config and splits the daemon's samples
into its buckets, so it cannot rot: the engine's ``llama_decode`` call is found where the script looks for it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench" / "decode_profile.py"


def test_tiny_run_splits_every_level_s_samples(tmp_path):
    out = tmp_path / "profile.json"
    # --stream-interval: the LLM's option written into the daemon's config (the script checks it landed there).
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--stream-interval", "2", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["tiny"] is True and res["stream_interval"] == 2 and [lv["streams"] for lv in res["levels"]] == [1, 2]
    for lv in res["levels"]:
        assert lv["decode_tok_s"] > 0 and lv["cpu_s_total"] > 0
        share = lv["engine_share"]
        assert sum(share.values()) == pytest.approx(1, abs=1e-3)
        # Decoding all along: the kernels' line was found, and the engine was not idle throughout.
        assert share.get("engine: llama_decode", 0) > 0.2, lv
        assert set(share) <= {"engine: llama_decode", "engine: sampling", "engine: emitting", "engine: python",
                              "engine: waiting"}
    assert "llama_decode" in proc.stdout and "busiest threads" in proc.stdout
