"""scripts/bench/peers.py runs end to end (--tiny, the llama-cpp pair) and writes every figure, so it cannot rot."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench" / "peers.py"


def positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def test_tiny_llama_cpp_pair_writes_every_figure(tmp_path):
    out = tmp_path / "peers.json"
    # Two servers start one after the other; HF_HUB_OFFLINE comes from conftest's environment.
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--pair", "llama-cpp", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["tiny"] is True and res["endpoint"] == "/v1/completions"
    assert list(res["pairs"]) == ["llama-cpp"]  # only the pair asked for

    pair = res["pairs"]["llama-cpp"]
    assert "skipped" not in pair, pair
    levels = [str(c) for c in res["concurrency"]]
    for role in ("headrace", "peer"):
        measured = pair[role]
        assert sorted(measured["levels"]) == sorted(levels), role
        for conc, figures in measured["levels"].items():
            assert figures["requests"] == int(conc) * res["rounds"], (role, conc, figures)
            assert positive(figures["tokens"]) and positive(figures["tok_s"]), (role, conc, figures)
        assert positive(measured["ttft"]["ttft_s"]) and positive(measured["ttft"]["prompt_tokens"]), measured["ttft"]
        assert len(measured["ttft"]["ttft_s_reps"]) == res["ttft_reps"]
        assert "other_processes" in measured["cpu_cores"]
    # headrace reports its usage when streaming; llama_cpp.server does not.
    assert all(positive(f["tokens_reported"]) for f in pair["headrace"]["levels"].values())
    # Both servers load the same converted GGUF.
    assert pair["settings"]["model_file"] in pair["peer"]["argv"]
    assert sorted(pair["ratios"]["tok_s"]) == sorted(levels)
    assert all(positive(r) for r in pair["ratios"]["tok_s"].values()) and positive(pair["ratios"]["ttft"])
    assert positive(res["meta"]["elapsed_s"])
    # The table printed after the JSON was written.
    assert "decode tok/s, 1 stream" in proc.stdout and "TTFT" in proc.stdout
