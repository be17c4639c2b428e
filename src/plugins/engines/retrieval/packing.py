"""Padding-free batches for encoder models: several sequences share one row.

A padded batch of short sentences spends most of its compute on padding (the
batch is as long as its longest sentence). Packing places sequences end to end
in rows of about ``row_tokens`` tokens, restarts the position ids for each one,
and gives attention a block-diagonal mask so no sequence sees another. The
linear layers, where nearly all the FLOPs are, then run on real tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # (rows, width)
    position_ids: torch.Tensor  # (rows, width)
    attention_mask: torch.Tensor  # (rows, 1, width, width), additive
    spans: list[tuple[int, int, int]]  # per input sequence: (row, start, length)


def pack(sequences: list[list[int]], row_tokens: int, dtype: torch.dtype) -> PackedBatch:
    """First-fit-decreasing bin packing of token sequences into rows."""
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    rows: list[list[int]] = []  # member indices per row
    used: list[int] = []
    for i in order:
        n = len(sequences[i])
        for r, total in enumerate(used):
            if total + n <= row_tokens:
                rows[r].append(i)
                used[r] += n
                break
        else:
            rows.append([i])
            used.append(n)
    width = max(used)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    position_ids = torch.zeros(len(rows), width, dtype=torch.long)
    segment = torch.full((len(rows), width), -1, dtype=torch.long)
    spans: list[tuple[int, int, int]] = [(0, 0, 0)] * len(sequences)
    for r, members in enumerate(rows):
        start = 0
        for i in members:
            n = len(sequences[i])
            input_ids[r, start : start + n] = torch.tensor(sequences[i])
            position_ids[r, start : start + n] = torch.arange(n)
            segment[r, start : start + n] = i
            spans[i] = (r, start, n)
            start += n
    same = segment.unsqueeze(2) == segment.unsqueeze(1)
    # Padding positions attend to themselves only, so softmax never sees an all-masked row.
    allowed = (same & (segment >= 0).unsqueeze(2)) | torch.eye(width, dtype=torch.bool)
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return PackedBatch(input_ids, position_ids, mask.unsqueeze(1), spans)


def mean_pool(hidden: torch.Tensor, spans: list[tuple[int, int, int]]) -> torch.Tensor:
    """Mean of each sequence's token states, in input order, as float32."""
    return torch.stack([hidden[r, s : s + n].float().mean(dim=0) for r, s, n in spans])
