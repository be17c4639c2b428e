"""Load a causal LM for the torch engine from an HF directory or a GGUF file.

A GGUF file is dequantised by transformers (about 16 s for SmolLM2 on two
cores), so the first load saves the result as safetensors in the cache dir and
later starts load that copy in well under two seconds.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def parse_dtype(name: str, key: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"{key}: unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


def gguf_cache_key(gguf: Path) -> str:
    """The name every engine's converted copy of ``gguf`` starts with: keyed by content identity,
    so a changed file is converted again, and engines find each other's copies."""
    stat = gguf.stat()
    digest = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return f"{gguf.stem}-{digest}"


def _gguf_cache_dir(gguf: Path, cache_dir: Path) -> Path:
    return cache_dir / "models" / gguf_cache_key(gguf)


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Dequantise a GGUF once into a float32 safetensors directory; return that directory.

    float32 keeps the dequantised values exact, so one copy serves every dtype.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = _gguf_cache_dir(gguf, cache_dir)
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    log.info("converting %s to %s (once)", gguf, target)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The dequantised weights are plain tensors now; saving with the GGUF
    # quantizer attached would try to write GGUF-packed weights.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    try:
        partial.rename(target)  # atomic: a crashed conversion never looks complete
    except OSError:  # another process finished the same conversion first
        shutil.rmtree(partial, ignore_errors=True)
    return target


def load_causal_lm(path: Path, cache_dir: Path, dtype: torch.dtype):
    """Return (model, tokenizer) in eval mode on the CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path.is_file() and path.suffix == ".gguf":
        path = convert_gguf(path, cache_dir)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer
