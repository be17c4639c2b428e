"""Tensors handed between co-hosted engines by reference (DyOrc §6.2).

An embedder's output reaches the vector store as the same memory: the store wraps
the tensor's buffer in an Arrow array (LanceDB's input format) and searches with
NumPy views of its rows, with no Python lists in between. When a tensor cannot be
wrapped as it is (another dtype, another device, a strided view), it is copied once
and the copy is counted, so a regression shows up as copied bytes, not as a silent
slowdown.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch


@dataclass
class HandoffStats:
    """Bytes an engine received from another one, and how many of them it had to copy."""

    received_bytes: int = 0
    copied_bytes: int = 0
    last_address: int = 0  # where the last handed-over buffer began, as the engine read it

    def as_dict(self) -> dict[str, int]:
        return {"handoff_received_bytes": self.received_bytes, "handoff_copied_bytes": self.copied_bytes}


def float32_rows(matrix: torch.Tensor, stats: HandoffStats) -> torch.Tensor:
    """``matrix`` as contiguous float32 rows in host memory: itself when it already is, else one counted copy."""
    nbytes = matrix.numel() * 4
    stats.received_bytes += nbytes
    if matrix.dtype != torch.float32 or matrix.device.type != "cpu" or not matrix.is_contiguous():
        matrix = matrix.to(device="cpu", dtype=torch.float32).contiguous()
        stats.copied_bytes += nbytes
    stats.last_address = matrix.data_ptr()
    return matrix


def arrow_vectors(matrix: torch.Tensor) -> pa.FixedSizeListArray:
    """A fixed-size-list Arrow array over the rows of a contiguous float32 CPU matrix, sharing its memory.

    The Arrow buffer holds a reference to the tensor, so the memory lives as long as either does.
    """
    n, dim = matrix.shape
    buffer = pa.foreign_buffer(matrix.data_ptr(), n * dim * 4, base=matrix)
    values = pa.Array.from_buffers(pa.float32(), n * dim, [None, buffer])
    return pa.FixedSizeListArray.from_arrays(values, dim)


def numpy_rows(matrix: torch.Tensor) -> np.ndarray:
    """The matrix as a NumPy array over the same memory (one view per row when indexed)."""
    return matrix.numpy()
