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


# A packed batch is as wide as its longest row rounded up to this, and its rows go to the model in groups of a
# power of two: torch's oneDNN kernels keep state for every input shape they have seen (about 2 MiB each in
# bfloat16 on a Sapphire Rapids Xeon), so exact shapes grow a daemon's memory for hours and pay a kernel
# build at each new one (scripts/bench/embed_shapes.py).
WIDTH_MULTIPLE = 16


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # (rows, width)
    position_ids: torch.Tensor  # (rows, width)
    attention_mask: torch.Tensor  # (rows, 1, width, width), additive
    members: list[int]  # the input sequences this batch holds
    spans: list[tuple[int, int, int]]  # per member: (row, start, length)


def pack(sequences: list[list[int]], row_tokens: int, dtype: torch.dtype,
         width_multiple: int = WIDTH_MULTIPLE) -> list[PackedBatch]:
    """First-fit-decreasing bin packing of token sequences into rows, the rows cut into batches of 2^k rows
    (a 13-row pack is batches of 8, 4 and 1), each as wide as its longest row rounded up to ``width_multiple``."""
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
    by_fill = sorted(range(len(rows)), key=lambda r: -used[r])  # the widest rows share a batch
    batches, start = [], 0
    while start < len(by_fill):
        size = 1 << ((len(by_fill) - start).bit_length() - 1)
        group = by_fill[start : start + size]
        batches.append(_batch([rows[r] for r in group], sequences, max(used[r] for r in group), width_multiple,
                              dtype))
        start += size
    return batches


def _batch(rows: list[list[int]], sequences: list[list[int]], longest: int, width_multiple: int,
           dtype: torch.dtype) -> PackedBatch:
    width = -(-max(longest, 1) // width_multiple) * width_multiple
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    position_ids = torch.zeros(len(rows), width, dtype=torch.long)
    segment = torch.full((len(rows), width), -1, dtype=torch.long)
    members: list[int] = []
    spans: list[tuple[int, int, int]] = []
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            n = len(sequences[i])
            input_ids[r, start : start + n] = torch.tensor(sequences[i], dtype=torch.long)
            position_ids[r, start : start + n] = torch.arange(n)
            segment[r, start : start + n] = i
            members.append(i)
            spans.append((r, start, n))
            start += n
    same = segment.unsqueeze(2) == segment.unsqueeze(1)
    # Padding positions attend to themselves only, so softmax never sees an all-masked row.
    allowed = (same & (segment >= 0).unsqueeze(2)) | torch.eye(width, dtype=torch.bool)
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return PackedBatch(input_ids, position_ids, mask.unsqueeze(1), members, spans)


def mean_pool(hidden: torch.Tensor, spans: list[tuple[int, int, int]]) -> torch.Tensor:
    """Mean of each sequence's token states, in input order, as float32."""
    return torch.stack([hidden[r, s : s + n].float().mean(dim=0) for r, s, n in spans])
