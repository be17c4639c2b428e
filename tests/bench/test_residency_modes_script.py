"""scripts/bench/residency_modes.py runs end to end (--tiny) and writes every figure, so it cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench" / "residency_modes.py"
CONFIG = ROOT / "configs" / "residency.toml"


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    """configs/residency.toml with its torch LLM and its embedder in float32 and the budget scaled to match (744 MiB:
    the embedder, the store and one LLM, as the shipped 384 MiB holds them in bfloat16; both LLMs still do not fit).
    A CPU without bf16 kernels (AVX2 only, as the 2-core dev box) emulates bf16 matmuls: there one tiny run's rag
    prefills cost ~23 of its 62 CPU-seconds, and the embedder's bf16 encodes were ~14 s of a documents run's 59."""
    text = CONFIG.read_text()
    for old, new in [('dtype = "bfloat16"\nthreads = 2', 'dtype = "float32"\nthreads = 2'),  # the torch LLM's only
                     ('[engines.options]\ndtype = "bfloat16"\n\n[[engines]]\nname = "lancedb"',  # the embedder's
                      '[engines.options]\ndtype = "float32"\n\n[[engines]]\nname = "lancedb"'),
                     ("budget_bytes = 402653184", "budget_bytes = 780140544")]:
        assert text.count(old) == 1, f"{CONFIG} changed: update this fixture ({old!r})"
        text = text.replace(old, new)
    path = tmp_path_factory.mktemp("residency") / "residency-float32.toml"
    path.write_text(text)
    return path


def test_tiny_run_writes_every_mode(tmp_path, config):
    out = tmp_path / "residency.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--config", str(config), "--out", str(out), "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["tiny"] is True and len(res["stream"]) == res["requests"] == 6
    assert list(res["modes"]) == ["all-resident", "lru", "lru-markov", "load-per-request"]
    for mode, figures in res["modes"].items():
        assert figures["e2e_s"]["all"]["n"] == 6, mode
        assert figures["peak_resident_bytes"] <= figures["budget_bytes"] or figures["budget_bytes"] == 0, mode
    assert res["modes"]["lru"]["evictions"] >= 1  # the budget holds one LLM: a switch of LLM evicts the other
    resident = res["modes"]["all-resident"]
    assert resident["loads"] == resident["evictions"] == resident["cold_start_waits"]["count"] == 0
    # Every request of load-per-request finds its evictable engines unloaded (the embedder is pinned).
    assert res["modes"]["load-per-request"]["loads"] >= sum(kind != "embed" for kind in res["stream"])


def test_tiny_documents_run_serves_rag_on_both_llms(tmp_path, config):
    out = tmp_path / "residency.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--config", str(config), "--workload", "documents", "--modes", "lru-markov",
                           "--doc-tokens", "150",  # --tiny's 400 halved: each rag run chunks, embeds and prefills less
                           "--out", str(out), "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["workload"] == "documents" and set(res["stream"]) <= {"rag", "rag2", "embed"}
    assert {"rag", "rag2"} <= set(res["stream"])  # the seeded stream of 6 has both tenants
    # One mode: the others differ in residency settings only, which the first test's modes cover.
    figures = res["modes"]["lru-markov"]
    assert figures["llms"]["rag"] != figures["llms"]["rag2"]
    assert sum(figures["e2e_s"][kind]["n"] for kind in ("rag", "rag2", "embed") if kind in figures["e2e_s"]) == 6
