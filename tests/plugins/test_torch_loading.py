"""The dtype option: ``auto`` picks bfloat16 only where the CPU has bf16 kernels."""

from __future__ import annotations

import pytest
import torch

from headrace.plugins.engines.torch_loading import cpu_has_bf16_kernels, parse_dtype


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
