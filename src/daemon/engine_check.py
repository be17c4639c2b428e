"""``headrace check``: prove that each native engine of a config runs on this machine, in child processes.

scripts/setup ends with it, so a build that cannot run here fails the setup, not the first request. A
native fault (SIGILL from kernels the CPU lacks, SIGSEGV) kills only the child; the report names the
engine, how the child died, the CPU and its flags, and the one command that fixes it.

- llama-cpp engines: the CPU backend chooser of ``llama_cpp.cpu`` on the engine's own model (a short
  prefill and decode per variant tried, best first); the same check runs when the engine loads in
  ``headrace serve``, before the daemon reports ready.
- engines on torch (torch, sentence-transformers, cross-encoder): a matmul in the dtype ``auto`` picks
  here (bfloat16 through oneDNN's AVX-512/AMX kernels where it has them), in a child.
- LLM engines (llama-cpp, torch), once they run: their numbers (``quality_check``): next-token distributions on
  canary prompts against a float32 reference on the same file, in a child; a wrong kernel, variant or build
  fails the check as a SIGILL does.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from headrace.daemon.config import Config
from headrace.daemon.quality_check import check_quality
from headrace.plugins.engines.llama_cpp.cpu import (FIX_COMMAND, VARIANT_ENV, NoRunnableVariant, ProbeModel,
                                                    chosen_variant, cpu_flags, exit_cause, library_dir, stderr_tail,
                                                    variant_name)
from headrace.plugins.engines.llama_cpp.options import parse_options
from headrace.plugins.protocols import EngineSpec

TORCH_PLUGINS = {"torch", "sentence-transformers", "cross-encoder"}
TORCH_FIX = "scripts/setup (it installs torch's CPU build)"
# The matmul of a 135M model's MLP, in the dtype the engines will use: the kernels a forward pass runs.
_TORCH_CHILD = """
import torch
from headrace.plugins.engines.models.loading import auto_dtype
dtype = auto_dtype("cpu")
x, w = torch.randn(64, 576, dtype=dtype), torch.randn(1536, 576, dtype=dtype)
y = torch.nn.functional.linear(x, w).float()
ref = torch.nn.functional.linear(x.float(), w.float())
assert torch.allclose(y, ref, rtol=0.05, atol=0.5), float((y - ref).abs().max())
print(str(dtype).removeprefix("torch."))
"""


@dataclass
class CheckResult:
    engine: str
    plugin: str
    ok: bool
    detail: str
    wrong_numbers: bool = False  # it runs, but its numbers are off the reference's (not a crash)


def check_engines(config: Config) -> list[CheckResult]:
    """One result per native engine of ``config``; engines with no native library of their own are left out."""
    results: list[CheckResult] = []
    torch_result: CheckResult | None = None
    for ec in config.engines:
        if ec.plugin == "llama-cpp":
            results.append(_check_llama_cpp(config, EngineSpec(ec.name, ec.plugin, ec.model, dict(ec.options))))
        elif ec.plugin in TORCH_PLUGINS:
            torch_result = torch_result or _check_torch()
            result = CheckResult(ec.name, ec.plugin, torch_result.ok, torch_result.detail)
            if ec.plugin == "torch" and result.ok:
                result = _with_numbers(result, config, ec.model, dict(ec.options), None)
            results.append(result)
    return results


def _with_numbers(result: CheckResult, config: Config, model: str | None, options: dict,
                  library: Path | None) -> CheckResult:
    """``result`` (the engine runs) and its numbers against the reference."""
    numbers = check_quality(result.engine, result.plugin, model, options, config.data.cache_path(), library)
    return CheckResult(result.engine, result.plugin, numbers.ok, f"{result.detail}; {numbers.detail}",
                       wrong_numbers=not numbers.ok and not numbers.crashed)


def _check_llama_cpp(config: Config, spec: EngineSpec) -> CheckResult:
    options = parse_options(spec)
    cache_dir = config.data.cache_path()
    t0 = time.monotonic()
    try:
        library = chosen_variant(library_dir(), ProbeModel(options.path, cache_dir, options.quantize,
                                                           options.threads), cache_dir)
    except (NoRunnableVariant, RuntimeError) as exc:
        return CheckResult(spec.name, spec.plugin, False, str(exc))
    ran = CheckResult(spec.name, spec.plugin, True, f"CPU backend {variant_name(library)}, a prefill and decode "
                                                     f"answered ({time.monotonic() - t0:.1f} s)")
    return _with_numbers(ran, config, spec.model, dict(spec.options), library)


def _check_torch() -> CheckResult:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _TORCH_CHILD], capture_output=True,
                          text=True, timeout=300)
    if done.returncode == 0:
        dtype = done.stdout.strip().splitlines()[-1]
        return CheckResult("", "torch", True, f"{dtype} matmul answered ({time.monotonic() - t0:.1f} s)")
    return CheckResult("", "torch", False, f"torch's check {exit_cause(done.returncode)} ({cpu_flags()}): "
                                           f"{stderr_tail(done.stderr, 4)}. "
                                           f"Fix: {TORCH_FIX}")


def report(results: list[CheckResult]) -> tuple[str, int]:
    """The lines to print and the exit status: 0 when every engine runs (and its numbers are within the bounds),
    1 otherwise."""
    lines = [f"{'ok ' if r.ok else 'FAILED '} {r.engine} ({r.plugin}): {r.detail}" for r in results]
    failed = [r for r in results if not r.ok and not r.wrong_numbers]
    wrong = [r for r in results if r.wrong_numbers]
    if failed:
        lines.append(f"headrace check: {len(failed)} engine(s) cannot run on this machine ({cpu_flags()}); "
                     f"fix: `{FIX_COMMAND}` for llama-cpp engines")
    if wrong:
        lines.append(f"headrace check: {len(wrong)} engine(s) run but compute wrong numbers on this machine "
                     f"({cpu_flags()}): their next-token distributions are off the float32 reference's on the same "
                     f"file. Fix: `{FIX_COMMAND}`, or take another CPU variant by hand ({VARIANT_ENV}=<variant>) for "
                     f"llama-cpp engines; dtype = \"float32\" for torch engines")
    return "\n".join(lines), 1 if failed or wrong else 0
