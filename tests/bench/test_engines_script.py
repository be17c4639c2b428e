"""scripts/bench/engines.py runs end to end (--tiny) and writes every figure, so it cannot rot unnoticed;
it refuses to start when an engine it is asked for cannot run, and keeps what it measured when one fails later.

The tiny run is the script in its own interpreter, as a user runs it (run in the test's process it once took 497 s
against 122 s, on a busy machine: not worth the interpreter it saves); it measures the HTTP path on the session's
daemon (``--url``: the default config, already loaded for the other tests) rather than starting a daemon of its own.
The refusal, which loads nothing, runs its ``main()`` in this process."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import API_KEY, script_in_process

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench" / "engines.py"

LEVEL_FIGURES = ("tokens", "tok_s", "decode_tok_s", "ttft_p50_s")
PREFILL_FIGURES = ("prompts", "prompt_tokens_avg", "one_tok_s", "concurrent_s", "concurrent_tok_s")
FORK_FIGURES = ("prefix_tokens", "suffix_tokens_avg", "contexts", "full_s", "shared_s", "children_only_s", "ratio",
                "ratio_children_only", "full_tok_s")
SCORING_FIGURES = ("prompts", "prompt_tokens_avg", "shared_prefix_tokens", "token_ids", "s", "prompts_per_s", "tok_s")
CACHE_FIGURES = ("prompts", "prompt_tokens_avg", "prefix_tokens", "s", "tok_s", "hit_tokens", "speedup_over_cache_off")
EMBED_FIGURES = ("sentences", "avg_chars", "batch1_per_s", "batch32_per_s", "ratio", "one_call_per_s")


def positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def run_script(*args: str, vllm_venv: Path, timeout: int) -> subprocess.CompletedProcess:
    # The script's own interpreter and model cache; HF_HUB_OFFLINE comes from conftest's environment.
    env = {**os.environ, "HEADRACE_VLLM_VENV": str(vllm_venv)}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env=env)


def fake_vllm_venv(root: Path) -> Path:
    """A venv whose python passes the script's import check, then fails the measuring run."""
    python = root / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\ncase "$*" in *"import vllm"*) exit 0;; esac\n'
                      'echo "fake vllm venv: this run fails" >&2\nexit 3\n')
    python.chmod(0o755)
    return root


def test_tiny_run_writes_every_figure(tmp_path, server):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/setup builds it)")
    # The script's own test (vllm importable here), not headrace_vllm's: the plugin tests load that package
    # from its source tree into sys.modules, so its spec depends on which tests this worker ran before.
    if importlib.util.find_spec("vllm"):
        pytest.skip("vllm runs in this interpreter: the fake vllm venv would not be used")
    out = tmp_path / "engines.json"
    # Two LLM engines, so the side-by-side table runs too; then a vllm whose run fails after both
    # were measured: the script goes on, keeps every figure, names the failure and exits 1.
    proc = run_script("--tiny", "--llm", "torch", "llama-cpp", "vllm", "--out", str(out),
                      "--url", server.base_url, "--api-key", API_KEY,
                      vllm_venv=fake_vllm_venv(tmp_path / "fake-vllm"), timeout=600)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "fake vllm venv: this run fails" in proc.stderr
    assert "FAILED" in proc.stderr and "vllm: RuntimeError" in proc.stderr, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["tiny"] is True
    assert res["complete"] is False and list(res["failed"]) == ["vllm"], res["failed"]
    assert sorted(res["llm"]) == ["llama-cpp", "torch"]
    assert isinstance(res["cpu"]["avx2"], bool) and isinstance(res["cpu"]["avx512"], list)

    levels = {plugin: llm["decode"]["levels"] for plugin, llm in res["llm"].items()}
    levels["http"] = res["http"]["levels"]
    for path, by_conc in levels.items():
        assert sorted(by_conc) == ["1", "2"], path
        for conc, figures in by_conc.items():
            for name in LEVEL_FIGURES:
                assert positive(figures[name]), (path, conc, name, figures)
    assert "other_processes" in res["http"]["cpu_cores"]
    assert res["http"]["url"] == server.base_url  # measured there, with the key it asks for
    assert all(positive(r) for r in res["ratios"]["http_over_direct"].values())

    for plugin, llm in res["llm"].items():
        for part, names in (("prefill", PREFILL_FIGURES), ("fork", FORK_FIGURES), ("scoring", SCORING_FIGURES),
                            ("prefix_cache", CACHE_FIGURES)):
            assert "other_processes" in llm[part]["cpu_cores"], (plugin, part)
            for name in names:
                assert positive(llm[part][name]), (plugin, part, name, llm[part])
        # What the engine computes is measured with its prefix cache off; the cache row has it on.
        assert llm["prefill"]["prefix_cache"] == llm["fork"]["prefix_cache"] == "off", plugin
        assert llm["scoring"]["prefix_cache"] == "off", plugin
        assert llm["prefill"]["distinct_prefixes"] is True
        assert llm["prefix_cache"]["prefix_cache"].startswith("on")
        # The children of one parent were prefilled together, as the engine reported to its batch observer.
        fork = llm["fork"]
        assert fork["prefill_batch_sizes"] and max(fork["prefill_batch_sizes"]) == fork["contexts"], plugin
        assert llm["scoring"]["prompts"] == 2 and llm["scoring"]["shared_prefix_tokens"] > 0
        assert positive(res["ratios"]["fork_speedup"][plugin])
        assert positive(res["ratios"]["prefix_cache_speedup"][plugin])

    embed = res["embed"]
    for name in EMBED_FIGURES:
        assert positive(embed[name]), (name, embed)
    assert positive(res["meta"]["elapsed_s"])
    # The report printed after the JSON was written.
    assert "CPU: " in proc.stdout and "avx2" in proc.stdout
    assert f"server at {server.base_url}" in proc.stdout
    for heading in ("== LLM decode: smollm2 on torch", "== LLM decode: smollm2 on llama-cpp", "== Prefill on torch",
                    "== Fork on torch", "== Scoring on torch", "== Prefix cache on torch", "measures the cache",
                    "== LLM engines side by side", "prefill tok/s, 1 prompt alone",
                    "prefill tok/s, 2 prompts concurrent", "scoring prompts/s", "== Embeddings"):
        assert heading in proc.stdout, heading


def test_a_missing_engine_stops_the_script_before_anything_is_measured(tmp_path, capfd):
    if importlib.util.find_spec("vllm"):  # as the script decides; see above
        pytest.skip("vllm runs in this interpreter: no venv is looked for")
    out = tmp_path / "engines.json"
    missing = tmp_path / "no-such-venv"
    t0 = time.monotonic()
    # In this process: it loads nothing, so its own interpreter would be most of its time.
    proc = script_in_process(capfd, SCRIPT, "--tiny", "--llm", "torch", "vllm", "--out", str(out),
                             "--vllm-venv", str(missing))
    assert proc.returncode == 1
    assert "nothing measured" in proc.stderr, proc.stderr[-4000:]
    assert f"{missing / 'bin' / 'python'} does not exist" in proc.stderr
    assert "scripts/setup-vllm" in proc.stderr and "HEADRACE_VLLM_VENV" in proc.stderr
    assert not out.exists()
    assert "== LLM decode" not in proc.stdout
    assert time.monotonic() - t0 < 60  # no model was loaded
