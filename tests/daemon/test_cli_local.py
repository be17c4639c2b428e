"""`headrace run` and `headrace profile`: the engines loaded by the command itself, not by a daemon (run in its
own process, profile in the test's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, in_process


def cli(*args: str, timeout: float = 300, cwd=ROOT) -> subprocess.CompletedProcess:
    """The ``headrace`` command in its own process (``headrace run``: a smoke test of the entry point)."""
    env = {k: v for k, v in os.environ.items() if k != "HEADRACE_CONFIG"}
    return subprocess.run([sys.executable, "-m", "headrace.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, env={**env, "HF_HUB_OFFLINE": "1"})


@pytest.fixture
def headrace(monkeypatch):
    """The ``headrace`` command in this process (what fails before any engine loads): no interpreter to start."""
    from headrace.cli import main

    monkeypatch.delenv("HEADRACE_CONFIG", raising=False)
    monkeypatch.chdir(ROOT)
    return lambda *args: in_process(main, *args)


@pytest.mark.slow
def test_run_prints_result_and_node_timings_from_any_directory(tmp_path):
    # No --config and a working directory without configs/: the packaged default config serves.
    run_config = tmp_path / "run.json"
    run_config.write_text(json.dumps({"max_tokens": 64, "synthesis": "tree"}))
    doc = tmp_path / "doc.txt"
    doc.write_text("A headrace is the channel that carries water to a mill wheel.")
    out = cli("run", "naive_rag", "--input", "question=What does a headrace carry?",
              "--input", f"documents=@{doc.name}", "--run-config", str(run_config),
              "--set", "max_tokens=12", "--set", "synthesis=one_shot", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    head, _, table = out.stdout.partition("\n\n")
    result = json.loads(head)
    assert result["status"] == "succeeded" and result["result"]["answer"]
    assert "embed_chunks" in table and "all-minilm-l6-v2" in table
    assert "combine" not in table  # --set synthesis=one_shot overrode the file's tree
    for engine, plugin in (("smollm2", "llama-cpp"), ("all-minilm-l6-v2", "sentence-transformers"), ("lancedb", "lancedb")):
        assert f"loading {engine} ({plugin}) ..." in out.stderr
        assert f"loaded {engine} in " in out.stderr
    assert "%|" not in out.stderr and "Warning" not in out.stderr, out.stderr  # no library bars or warnings


def test_version(headrace):
    from headrace import __version__

    for args in (["--version"], ["version"]):
        out = headrace(*args)
        assert out.returncode == 0 and out.stdout.strip() == f"headrace {__version__}", out


def test_a_missing_input_file_is_one_line(headrace):
    out = headrace("run", "naive_rag", "--input", "question=q", "--input", "documents=@no/such/notes.txt")
    assert out.returncode == 2, out
    assert out.stderr == "headrace: --input documents: cannot read no/such/notes.txt: No such file or directory\n"


def test_run_flags_say_what_they_set(tmp_path, headrace):
    from headrace.daemon.commands import _run_config, build_parser

    run_config = tmp_path / "run.json"
    run_config.write_text(json.dumps({"top_k": 2, "optimize": {"passes": ["prefill_split"]}}))
    parser, _ = build_parser()
    args = parser.parse_args(["run", "naive_rag", "--config", "my.toml", "--run-config", str(run_config),
                              "--set", "top_k=4", "--set", "optimize.passes=[]", "--set", "synthesis=refine"])
    assert str(args.config) == "my.toml"  # --config is the daemon's TOML here as in serve
    assert _run_config(args) == {"top_k": 4, "optimize": {"passes": []}, "synthesis": "refine"}
    for bad, message in (("top_k", "expected key=value"), ("top_k.x=1", "not an object")):
        out = headrace("run", "naive_rag", "--input", "question=q", "--run-config", str(run_config), "--set", bad)
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out
    out = headrace("run", "naive_rag", "--config", str(tmp_path / "missing.toml"))
    assert out.returncode == 2 and "missing.toml" in out.stderr and "Traceback" not in out.stderr, out


def test_run_names_a_bad_input(headrace):
    out = headrace("run", "naive_rag", "--input", "question=q")
    assert out.returncode == 2 and "inputs.documents: required" in out.stderr
    out = headrace("run", "nope")
    assert out.returncode == 2 and "no workflow named 'nope'" in out.stderr


@pytest.mark.slow
def test_profile_finds_a_max_efficient_batch_size(headrace, monkeypatch):
    from headrace.daemon import profiling

    # In this process (no interpreter or torch import to pay for), with passes of a fifth of a second
    # instead of 3 s: the search over sizes 1, 2 and 4 is the same, its figures only noisier.
    monkeypatch.setattr(profiling, "PASS_SECONDS", 0.2)
    out = headrace("profile", "all-minilm-l6-v2", "--max-batch", "4", "--config", str(ROOT / "configs" / "default.toml"))
    assert out.returncode == 0, out.stderr
    assert "batch    1:" in out.stdout
    size = int(out.stdout.split("max efficient batch size for all-minilm-l6-v2: ")[1].split()[0])
    # Which size wins is a measurement (a loaded machine may find no gain past 1): assert only
    # that the answer is one of the sizes it tried, and that it prints the config to set.
    assert size in (1, 2, 4) and f"batch {size:>4}:" in out.stdout and "batch    8:" not in out.stdout
    assert f"max_efficient_batch_size = {size}" in out.stdout
