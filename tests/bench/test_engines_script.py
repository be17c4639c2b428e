"""scripts/bench/engines.py runs end to end (--tiny) and writes every figure, so it cannot rot unnoticed."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench" / "engines.py"

LEVEL_FIGURES = ("tokens", "tok_s", "decode_tok_s", "ttft_p50_s")
PREFIX_FIGURES = ("prefix_tokens", "suffix_tokens_avg", "contexts", "full_s", "shared_s", "children_only_s", "ratio",
                  "ratio_children_only", "prefill_tok_s")
EMBED_FIGURES = ("sentences", "avg_chars", "batch1_per_s", "batch32_per_s", "ratio", "one_call_per_s")


def positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def test_tiny_run_writes_every_figure(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/setup builds it)")
    out = tmp_path / "engines.json"
    # Two LLM engines, so the side-by-side table runs too. The script's own interpreter and model
    # cache; HF_HUB_OFFLINE comes from conftest's environment.
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--llm", "torch", "llama-cpp", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["tiny"] is True
    assert sorted(res["llm"]) == ["llama-cpp", "torch"]

    levels = {plugin: llm["decode"]["levels"] for plugin, llm in res["llm"].items()}
    levels["http"] = res["http"]["levels"]
    for path, by_conc in levels.items():
        assert sorted(by_conc) == ["1", "2"], path
        for conc, figures in by_conc.items():
            for name in LEVEL_FIGURES:
                assert positive(figures[name]), (path, conc, name, figures)
    assert "other_processes" in res["http"]["cpu_cores"]
    assert all(positive(r) for r in res["ratios"]["http_over_direct"].values())

    for plugin, llm in res["llm"].items():
        assert "other_processes" in llm["decode"]["cpu_cores"]
        prefix = llm["prefix"]
        for name in PREFIX_FIGURES:
            assert positive(prefix[name]), (plugin, name, prefix)
        # The children of one parent were prefilled together, as the engine reported to its batch observer.
        assert prefix["prefill_batch_sizes"] and max(prefix["prefill_batch_sizes"]) == prefix["contexts"], plugin

    embed = res["embed"]
    for name in EMBED_FIGURES:
        assert positive(embed[name]), (name, embed)
    assert positive(res["meta"]["elapsed_s"])
    # The report printed after the JSON was written.
    for heading in ("== LLM decode: smollm2 on torch", "== LLM decode: smollm2 on llama-cpp", "== Prefix reuse on",
                    "== LLM engines side by side", "== Embeddings"):
        assert heading in proc.stdout, heading
