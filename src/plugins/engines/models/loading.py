"""Load a causal LM for the torch engine from an HF directory or a GGUF file.

A GGUF file is dequantised by transformers (tens of seconds of CPU for SmolLM2:
its GGUF reader parses the file's metadata once for the config, once for the
weights, once for the tokenizer), so the first load saves the result as
safetensors in the cache dir and later starts load that copy in about a second.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from filelock import FileLock

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
AUTO = "auto"


def parse_dtype(name: str, key: str, device: str = "cpu") -> torch.dtype:
    """A dtype option: one of ``DTYPES``, or ``auto``, the fastest exact-enough one ``device`` runs natively."""
    if name == AUTO:
        return auto_dtype(device)
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"{key}: unknown dtype {name!r}; choose one of {sorted([AUTO, *DTYPES])}") from None


def auto_dtype(device: str) -> torch.dtype:
    """bfloat16 where the hardware has bf16 kernels, else float32 (as vLLM falls back on CPUs without them).

    On a CPU without AVX512 (an AVX2-only one) oneDNN has no bf16 GEMM and torch runs a bf16 matmul
    through a reference path: measured on the 2-core AVX2 dev VM, 1.1 GFLOP/s against float32's 57,
    which made prefill 5.5x and the MiniLM embedder 2.5-6x slower than in float32.
    """
    if device.startswith("cuda"):
        chosen = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    else:
        chosen = torch.bfloat16 if cpu_has_bf16_kernels() else torch.float32
    log.info("dtype auto on %s: %s", device, str(chosen).removeprefix("torch."))
    return chosen


def cpu_has_bf16_kernels() -> bool:
    try:  # oneDNN's own answer: AVX512-BF16, AMX, or its AVX512 emulation
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "VSX", "ZVECTOR", "AVX2")


def gguf_cache_key(gguf: Path) -> str:
    """The name every engine's converted copy of ``gguf`` starts with: keyed by the file's content, so a
    changed file is converted again, and every engine, venv and checkout holding the same file (pip
    installs one copy per venv) shares one conversion."""
    stat = gguf.stat()
    return f"{gguf.stem}-{_content_digest(str(gguf.resolve()), stat.st_size, stat.st_mtime_ns)}"


@functools.lru_cache(maxsize=64)
def _content_digest(path: str, size: int, mtime_ns: int) -> str:
    # Hashing 100 MB takes ~0.1 s: once per file version and process, not at every engine load.
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()[:16]


def made_once(target: Path, made: Callable[[Path], bool], make: Callable[[Path], None]) -> Path:
    """``target`` (a file or a directory), made by ``make`` once per cache. ``make`` writes to a partial path
    renamed into place when complete, so a crashed conversion never looks made; processes wanting the same
    target at once (two engines, two test workers, two daemons starting side by side) take turns on a lock
    file, and the second finds the first's result rather than spending the same minute of CPU again."""
    if made(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{target}.lock"):
        if not made(target):  # not made while this process waited
            partial = target.with_name(f"{target.name}.partial")  # this process's alone while it holds the lock
            _remove(partial)  # a crashed conversion's, if any
            try:
                make(partial)
            except BaseException:
                _remove(partial)
                raise
            _remove(target)  # a crashed conversion's leftovers, if any
            partial.rename(target)
    return target


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def tokenizer_cache_dir(gguf: Path, cache_dir: Path) -> Path:
    """Where the llama-cpp engine saves ``gguf``'s HF tokenizer (the torch engine's converted copy holds one too)."""
    return cache_dir / "models" / f"{gguf_cache_key(gguf)}.tokenizer"


def has_tokenizer(directory: Path) -> bool:
    return (directory / "tokenizer.json").exists() and (directory / "tokenizer_config.json").exists()


def _gguf_cache_dir(gguf: Path, cache_dir: Path) -> Path:
    return cache_dir / "models" / gguf_cache_key(gguf)


def _is_converted(target: Path) -> bool:
    return (target / "config.json").exists() and (target / "model.safetensors").exists()


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Dequantise a GGUF once into a float32 safetensors directory; return that directory.

    float32 keeps the dequantised values exact, so one copy serves every dtype.
    """
    target = _gguf_cache_dir(gguf, cache_dir)
    saved_tokenizer = tokenizer_cache_dir(gguf, cache_dir)  # the llama-cpp engine's, when it ran first
    return made_once(target, _is_converted, lambda partial: _convert(gguf, target, partial, saved_tokenizer))


def _convert(gguf: Path, target: Path, partial: Path, saved_tokenizer: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to %s (once)", gguf, target)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if has_tokenizer(saved_tokenizer):
        tokenizer = AutoTokenizer.from_pretrained(saved_tokenizer)
    else:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)  # parses the GGUF again
    # The dequantised weights are plain tensors now; saving with the GGUF
    # quantizer attached would try to write GGUF-packed weights.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)


def load_causal_lm(path: Path, cache_dir: Path, dtype: torch.dtype, tokenizer=None):
    """Return (model, tokenizer) in eval mode on the CPU; a reload passes the tokenizer it kept."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path.is_file() and path.suffix == ".gguf":
        path = convert_gguf(path, cache_dir)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer
