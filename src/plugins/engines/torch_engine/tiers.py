"""The torch core's side of ``kv_store``: a cached prefix's per-layer tensors saved to the tiers, and restored.

An entry's payload is every layer's K then V, (1, heads, n, head_dim) each, packed in one buffer in the
engine's dtype; a restore views that buffer (``torch.frombuffer``: no copy), so a restored prefix costs
host memory once. The namespace names the model file's content, the dtype and the KV's shape per token.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from headrace.plugins.engines.kvreuse.kv_store import EngineTiers, KVStore, open_store, payload_buffer
from headrace.plugins.engines.models.loading import gguf_cache_key
from headrace.plugins.engines.torch_engine.kv import LayerKV

log = logging.getLogger(__name__)


class TensorTiers(EngineTiers):
    """Save and restore a torch core's cached prefixes through a ``KVStore``; on the engine's worker thread."""

    def __init__(self, store: KVStore, layers: int, heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.store, self._layers, self._heads, self._head_dim, self._dtype = store, layers, heads, head_dim, dtype

    def save(self, layers: LayerKV, tokens: Sequence[int], partition: str = "") -> None:
        """Keep ``layers`` (the KV of exactly ``tokens``, block-aligned) in the tiers' ``partition``."""
        if self.store.holds(tokens, partition):
            return
        packed = torch.stack([torch.stack((k[0], v[0])) for k, v in layers])  # (layers, 2, heads, n, head_dim)
        raw = packed.contiguous().view(torch.uint8).numpy().reshape(-1)
        payload = payload_buffer(raw.nbytes)
        np.frombuffer(payload, dtype=np.uint8)[:] = raw
        self.store.put(tokens, payload, partition)

    def restore(self, tokens: Sequence[int], max_tokens: int, found: int,
                partition: str = "") -> tuple[list[int], LayerKV] | None:
        """The longest prefix of ``tokens`` (at most ``max_tokens``) the tiers hold in ``partition``, as the tokens it
        holds and their KV, if longer than the ``found`` tokens the cells hold; None otherwise (or if its file was
        bad)."""
        hit = self.store.match(tokens, max_tokens, partition)
        if hit is None or hit.tokens <= found:
            return None
        start = time.perf_counter()
        data = self.store.payload(hit)
        if data is None:
            return None
        layers = [(k[:, :, : hit.tokens], v[:, :, : hit.tokens]) for k, v in self.unpack(data, len(hit.entry.tokens))]
        self.store.used(hit, time.perf_counter() - start)
        return list(tokens[: hit.tokens]), layers

    def unpack(self, data: bytearray, n: int) -> LayerKV:
        """An entry's payload, the KV of ``n`` tokens, as per-layer views (no copy)."""
        packed = torch.frombuffer(data, dtype=self._dtype).view(self._layers, 2, self._heads, n, self._head_dim)
        return [(packed[i, 0, None], packed[i, 1, None]) for i in range(self._layers)]


def open_tensor_tiers(model_file: Path, config, dtype: torch.dtype, block: int, directory: Path,
                      host_bytes: int | None, disk_bytes: int | None, name: str) -> TensorTiers | None:
    """The core's tiers (``config``: the transformers model config), budgets None sized from the machine; None
    when both are off."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layers = config.num_hidden_layers
    namespace = (f"torch-layer-kv model={gguf_cache_key(model_file)} dtype={dtype} layers={layers} heads={heads} "
                 f"head_dim={head_dim}")
    store = open_store(namespace, block, directory, host_bytes, disk_bytes, name)
    return None if store is None else TensorTiers(store, layers, heads, head_dim, dtype)
