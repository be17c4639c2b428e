"""Retrieved documents placed at any position of a prompt on the torch engine (issue 49, part 2).

As on llama.cpp (``llama_cpp.placement``), a document's KV is computed once, alone from position 0 (``prepare``),
and kept in the engine's KV tiers (``kvreuse.documents``); a prefill that marks documents restores each one's
whole blocks past its first ``recompute_first`` tokens, and computes everything else in place (EPIC's repair).
Here that is ONE forward pass: the placed documents' KV is the pass's past, their K re-rotated to where they stand
(RoPE is a rotation by position, so K at position p + d is K at p rotated by d), and the computed tokens (the head,
each document's first tokens, the text between, the rest of the prompt) go in with their own positions and a 4D
mask that lets each one see every position before its own. The context's KV is then put in position order.

Only models whose every layer attends the whole context with plain RoPE: a sliding window (Gemma 3) would need
its own mask per layer kind, and a scaled RoPE (YaRN...) is not a pure rotation. Others prefill, said once in
the log.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from headrace.plugins.engines.kvreuse.documents import DocumentPlacement, held_documents
from headrace.plugins.engines.torch_engine import kv
from headrace.plugins.engines.torch_engine.tiers import TensorTiers

log = logging.getLogger(__name__)


@dataclass
class Placed:
    """A prompt composed with its documents placed: its KV in position order and its next-token logits."""

    kv: kv.LayerKV
    next_logits: torch.Tensor
    placed: int  # tokens restored rather than computed


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def why_not(model: Any) -> str | None:
    """Why ``model``'s KV cannot be shifted to a new position (None: it can)."""
    config = model.config
    if getattr(config, "sliding_window", None) or "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return "sliding-window attention: a shifted document would need each layer kind's own mask"
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None or getattr(rotary, "attention_scaling", 1.0) != 1.0:
        return "its position encoding is not a plain RoPE rotation"
    return None


@dataclass
class TensorPlacer(DocumentPlacement):
    model: Any
    tiers: TensorTiers | None

    def _refusal(self) -> str | None:
        return why_not(self.model)

    def _keep(self, tokens: list[int], partition: str) -> None:
        assert self.tiers is not None
        out = self.model(input_ids=torch.tensor([tokens]), use_cache=True, logits_to_keep=1)
        self.tiers.save(kv.layers_of(out.past_key_values), tokens, partition)

    def _shifted(self, layers: kv.LayerKV, length: int, delta: int) -> kv.LayerKV:
        """``layers`` (positions [0, length) of a document computed alone) with K rotated ``delta`` positions on."""
        k0 = layers[0][0]
        cos, sin = self.model.model.rotary_emb(k0, torch.full((1, length), delta))
        cos, sin = cos[:, None].to(torch.float32), sin[:, None].to(torch.float32)
        out = []
        for k, v in layers:
            k32 = k[:, :, :length].to(torch.float32)
            out.append(((k32 * cos + rotate_half(k32) * sin).to(k.dtype), v[:, :, :length]))
        return out

    def compose(self, tokens: Sequence[int], documents: Sequence[tuple[int, int]], partition: str) -> Placed | None:
        """``tokens`` with the leading run of documents the tiers hold placed, everything else computed in one
        forward pass; None when none is held (the caller prefills)."""
        if not documents or not self.usable():
            return None
        assert self.tiers is not None
        start = time.perf_counter()
        held = held_documents(self.store, tokens, documents, partition, self.block)
        if not held:
            self.stats.fallbacks += 1
            return None
        past: list[kv.LayerKV] = []
        past_positions: list[torch.Tensor] = []
        computed = torch.ones(len(tokens), dtype=torch.bool)
        for doc in held:
            first = min(self.recompute_first, doc.length)
            if first == doc.length:
                continue
            try:
                layers = self.tiers.unpack(doc.payload, doc.stored)
            except RuntimeError as exc:  # a damaged entry (its size no longer the KV's)
                log.warning("engine %s: a document's stored KV could not be placed (%s); prefilling the prompt",
                            self.name, exc)
                self.stats.fallbacks += 1
                return None
            past.append([(k[:, :, first:], v[:, :, first:]) for k, v in self._shifted(layers, doc.length, doc.position)])
            past_positions.append(torch.arange(doc.position + first, doc.position + doc.length))
            computed[doc.position + first:doc.position + doc.length] = False
        new_positions = torch.nonzero(computed).flatten()
        ids = torch.tensor(tokens)[new_positions]
        if past:
            cache = kv.to_cache([(torch.cat([p[i][0] for p in past], dim=2), torch.cat([p[i][1] for p in past], dim=2))
                                 for i in range(len(past[0]))])
            kv_positions = torch.cat([*past_positions, new_positions])
        else:
            cache, kv_positions = kv.DynamicCache(), new_positions
        dtype = self.model.dtype
        # Each computed token sees every position up to its own: placed cells and computed tokens alike.
        allowed = kv_positions[None, :] <= new_positions[:, None]
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
        out = self.model(input_ids=ids[None], position_ids=new_positions[None], past_key_values=cache,
                         attention_mask=mask, use_cache=True, logits_to_keep=1)
        order = torch.argsort(kv_positions)
        layers = [(k.index_select(2, order), v.index_select(2, order)) for k, v in kv.layers_of(out.past_key_values)]
        placed = len(tokens) - len(new_positions)
        self.stats.placements += 1
        self.stats.placed_tokens += placed
        self.stats.recomputed_tokens += len(new_positions)
        self.stats.seconds += time.perf_counter() - start
        return Placed(layers, out.logits[0, -1].float(), placed)
