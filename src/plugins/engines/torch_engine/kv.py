"""KV tensors for the torch engine: per-context storage and the decode batch.

A context at rest owns one (key, value) pair per layer, shaped (1, heads,
length, head_dim). The decode batch is one transformers ``DynamicCache`` whose
rows are contexts left-padded to a common length, with a 0/1 attention mask
marking the padding. Rows join and leave between steps; padding every row
shares is trimmed away so the batch never carries dead columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


def to_cache(layers: LayerKV) -> DynamicCache:
    cache = DynamicCache()
    for i, (k, v) in enumerate(layers):
        cache.update(k, v, i)
    return cache


def layers_of(cache: DynamicCache) -> LayerKV:
    return [(layer.keys, layer.values) for layer in cache.layers]


def expand(layers: LayerKV, batch: int) -> DynamicCache:
    """A cache holding ``batch`` copies of one context, as views (no copy yet)."""
    return to_cache([(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1)) for k, v in layers])


def row(cache: DynamicCache, index: int, start: int, end: int) -> LayerKV:
    """A private copy of one row's KV between two sequence positions."""
    return [
        (layer.keys[index : index + 1, :, start:end].clone(), layer.values[index : index + 1, :, start:end].clone())
        for layer in cache.layers
    ]


class DecodeBatch:
    """The rows currently decoding: their KV cache and padding mask."""

    def __init__(self) -> None:
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros(0, 0, dtype=torch.long)

    @property
    def size(self) -> int:
        return self.mask.shape[0]

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def add(self, contexts: list[LayerKV]) -> None:
        """Append rows, left-padding everyone to the longest."""
        lengths = [kv[0][0].shape[2] for kv in contexts]
        width = max([self.width, *lengths])
        parts: list[LayerKV] = []
        masks = []
        if self.cache is not None:
            parts.append(_left_pad(layers_of(self.cache), width - self.width))
            masks.append(F.pad(self.mask, (width - self.width, 0)))
        for kv, n in zip(contexts, lengths):
            parts.append(_left_pad(kv, width - n))
            masks.append(F.pad(torch.ones(1, n, dtype=torch.long), (width - n, 0)))
        n_layers = len(parts[0])
        self.cache = to_cache(
            [
                (torch.cat([p[i][0] for p in parts]), torch.cat([p[i][1] for p in parts]))
                for i in range(n_layers)
            ]
        )
        self.mask = torch.cat(masks)

    def step_mask(self) -> torch.Tensor:
        """The mask for a forward pass that appends one token to every row."""
        self.mask = F.pad(self.mask, (0, 1), value=1)
        return self.mask

    def keep(self, indices: list[int]) -> None:
        """Drop every row not in ``indices`` and trim padding that all rows share."""
        if not indices:
            self.cache, self.mask = None, torch.zeros(0, 0, dtype=torch.long)
            return
        assert self.cache is not None
        idx = torch.tensor(indices)
        mask = self.mask.index_select(0, idx)
        # Leading columns that are padding in every remaining row.
        trim = int((mask.cumsum(dim=1) == 0).all(dim=0).sum())
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, idx)[:, :, trim:]
            layer.values = layer.values.index_select(0, idx)[:, :, trim:]
        self.mask = mask[:, trim:]


def _left_pad(layers: LayerKV, n: int) -> LayerKV:
    if n == 0:
        return layers
    return [(F.pad(k, (0, 0, n, 0)), F.pad(v, (0, 0, n, 0))) for k, v in layers]
