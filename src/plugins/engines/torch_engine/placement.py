"""Retrieved documents placed at any position of a prompt on the torch engine (issue 49, part 2).

As on llama.cpp (``llama_cpp.placement``), a document's KV is computed once, alone from position 0 (``prepare``),
and kept in the engine's KV tiers (``kvreuse.documents``); a prefill that marks documents restores each one's
whole blocks past its first ``recompute_first`` tokens, and computes everything else in place (EPIC's repair).
Here that is ONE forward pass: the placed documents' KV is the pass's past, their K re-rotated to where they stand
(RoPE is a rotation by position, so K at position p + d is K at p rotated by d), and the computed tokens (the head,
each document's first tokens, the text between, the rest of the prompt) go in with their own positions and a 4D
mask that lets each one see every position before its own. The context's KV is then put in position order.

Besides each document's first tokens, a share of its other tokens can be computed again (``Selection``), chosen on
one early layer (the check layer) where a pass of the layers before it over the whole prompt says what a full
prefill would compute there (CacheBlend's selective recompute, on the torch engine only: llama.cpp's API runs
whole forward passes):

- ``deviation`` (CacheBlend): the tokens whose placed K differs most from the fresh one;
- ``relevance`` (ProphetKV, A^3): the tokens the prompt's tail (what follows the last placed document, where the
  answer starts) attends most on that layer.

Only models whose every layer attends the whole context with plain RoPE: a sliding window (Gemma 3) would need
its own mask per layer kind, and a scaled RoPE (YaRN...) is not a pure rotation. Others prefill, said once in
the log.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from headrace.plugins.engines.kvreuse.documents import DocumentPlacement, held_documents
from headrace.plugins.engines.torch_engine import kv
from headrace.plugins.engines.torch_engine.tiers import TensorTiers

log = logging.getLogger(__name__)

FIRST, DEVIATION, RELEVANCE = "first", "deviation", "relevance"
SELECTIONS = (FIRST, DEVIATION, RELEVANCE)


@dataclass(frozen=True)
class Selection:
    """Which placed tokens are computed again beyond each document's first ones: none (``first``, EPIC's repair
    alone), or ``ratio`` of them chosen ``by`` deviation or relevance on the check ``layer``."""

    by: str = FIRST
    ratio: float = 0.15
    layer: int = 1


def selection_options(opts: dict[str, Any], key: str) -> Selection:
    """``place_select`` (first), ``place_select_ratio`` (0.15) and ``place_select_layer`` (1), popped from ``opts``."""
    by = opts.pop("place_select", FIRST)
    if by not in SELECTIONS:
        raise ValueError(f"{key}.place_select: must be one of {', '.join(SELECTIONS)}, not {by!r}")
    ratio = opts.pop("place_select_ratio", 0.15)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        raise ValueError(f"{key}.place_select_ratio: must be a number from 0 to 1, not {ratio!r}")
    layer = opts.pop("place_select_layer", 1)
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 1:
        raise ValueError(f"{key}.place_select_layer: must be an integer >= 1, not {layer!r}")
    return Selection(by, float(ratio), layer)


class _Reached(Exception):
    """Ends the check pass at the check layer's attention: the layers after it are not needed."""


@dataclass
class Placed:
    """A prompt composed with its documents placed: its KV in position order and its next-token logits."""

    kv: kv.LayerKV
    next_logits: torch.Tensor
    placed: int  # tokens restored rather than computed


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ([batch, heads, tokens, dim]) rotated by RoPE's ``cos`` and ``sin`` ([batch, tokens, dim])."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


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
    selection: Selection = Selection()

    def _refusal(self) -> str | None:
        if self.selection.layer >= self.model.config.num_hidden_layers:
            return (f"place_select_layer {self.selection.layer} is past the model's last layer "
                    f"({self.model.config.num_hidden_layers - 1})")
        return why_not(self.model)

    def _keep(self, tokens: list[int], partition: str) -> None:
        assert self.tiers is not None
        out = self.model(input_ids=torch.tensor([tokens]), use_cache=True, logits_to_keep=1)
        self.tiers.save(kv.layers_of(out.past_key_values), tokens, partition)

    def _place(self, context: kv.LayerKV, layers: kv.LayerKV, length: int, delta: int) -> None:
        """``layers`` (positions [0, length) of a document computed alone) written into ``context`` at ``delta``,
        K rotated ``delta`` positions on."""
        cos, sin = self.model.model.rotary_emb(layers[0][0], torch.full((1, length), delta))
        cos, sin = cos.float(), sin.float()
        for (k_to, v_to), (k, v) in zip(context, layers):
            k_to[:, :, delta:delta + length] = rotated(k[:, :, :length].float(), cos, sin)
            v_to[:, :, delta:delta + length] = v[:, :, :length]

    def _check_layer(self, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Q and K (RoPE applied; float32, [heads, tokens, dim]) of every token of ``tokens`` on the check layer as a
        full prefill computes them: the layers before it run over the whole prompt, the rest not at all."""
        attention = self.model.model.layers[self.selection.layer].self_attn
        seen: dict[str, Any] = {}

        def reach(module: Any, args: tuple, kwargs: dict) -> None:
            seen["hidden"] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            seen["rope"] = kwargs["position_embeddings"]
            raise _Reached

        hook = attention.register_forward_pre_hook(reach, with_kwargs=True)
        try:
            self.model.model(input_ids=torch.tensor([tokens]), use_cache=False)
        except _Reached:
            pass
        finally:
            hook.remove()
        x, (cos, sin) = seen["hidden"], seen["rope"]
        shape = (*x.shape[:-1], -1, attention.head_dim)
        q, k = (proj(x).view(shape).transpose(1, 2).float() for proj in (attention.q_proj, attention.k_proj))
        cos, sin = cos.float(), sin.float()
        return rotated(q, cos, sin)[0], rotated(k, cos, sin)[0]

    def _scores(self, tokens: Sequence[int], candidates: list[tuple[int, torch.Tensor]], placed_k: torch.Tensor,
                tail: int) -> torch.Tensor:
        """One score per candidate token (``candidates``: each document's position and the indices in it that are
        candidates; ``placed_k``: the composed context's K on the check layer), the highest to be computed again;
        ``tail``: where the tokens after the last placed document begin."""
        q, k = self._check_layer(tokens)
        if self.selection.by == DEVIATION:
            return torch.cat([((k[:, position + index] - placed_k[0, :, position + index].float()) ** 2).sum(dim=(0, 2))
                              for position, index in candidates])
        # Relevance: the attention of the tail's tokens (after the last placed document) on this layer, each
        # document token's largest weight over the heads, averaged over those tokens.
        k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
        logits = q[:, tail:] @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
        later = torch.arange(k.shape[1])[None, :] > torch.arange(tail, len(tokens))[:, None]
        weights = logits.masked_fill(later, float("-inf")).softmax(dim=-1).amax(dim=0).mean(dim=0)
        return torch.cat([weights[position + index] for position, index in candidates])

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
        # The context's KV in position order from the start: each document's shifted KV written where it stands,
        # the computed tokens' slots masked out of the pass's past and filled from its output after (a gather of
        # every cell into position order cost a fifth of a placement).
        n = len(tokens)
        context: kv.LayerKV = []
        spans: list[tuple[int, torch.Tensor]] = []  # (position, the indices placed) a document
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
            if not context:
                context = [(k.new_zeros((*k.shape[:2], n, k.shape[3])), v.new_zeros((*v.shape[:2], n, v.shape[3])))
                           for k, v in layers]
            self._place(context, layers, doc.length, doc.position)
            spans.append((doc.position, torch.arange(first, doc.length)))
        chosen = round(self.selection.ratio * sum(len(index) for _, index in spans))
        if self.selection.by != FIRST and spans and chosen:
            scores = self._scores(tokens, spans, context[self.selection.layer][0],
                                  tail=held[-1].position + held[-1].length)
            again = torch.zeros(len(scores), dtype=torch.bool)
            again[torch.topk(scores, chosen).indices] = True
            kept, offset = [], 0
            for position, index in spans:
                kept.append((position, index[~again[offset:offset + len(index)]]))
                offset += len(index)
            spans = kept
        placed_cells = torch.zeros(n, dtype=torch.bool)
        for position, index in spans:
            placed_cells[position + index] = True
        new_positions = torch.nonzero(~placed_cells).flatten()
        ids = torch.tensor(tokens)[new_positions]
        # Each computed token sees every computed token up to its own position and, past them, every placed cell.
        allowed = new_positions[None, :] <= new_positions[:, None]
        if context:
            cache = kv.to_cache(context)
            allowed = torch.cat([(torch.arange(n)[None, :] <= new_positions[:, None]) & placed_cells[None, :],
                                 allowed], dim=1)
        else:
            cache = kv.DynamicCache()
        dtype = self.model.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
        out = self.model(input_ids=ids[None], position_ids=new_positions[None], past_key_values=cache,
                         attention_mask=mask, use_cache=True, logits_to_keep=1)
        layers = kv.layers_of(out.past_key_values)
        if context:
            for (k, v), (k_out, v_out) in zip(context, layers):
                k.index_copy_(2, new_positions, k_out[:, :, n:])
                v.index_copy_(2, new_positions, v_out[:, :, n:])
            layers = context
        placed = len(tokens) - len(new_positions)
        self.stats.placements += 1
        self.stats.placed_tokens += placed
        self.stats.recomputed_tokens += len(new_positions)
        self.stats.seconds += time.perf_counter() - start
        return Placed(layers, out.logits[0, -1].float(), placed)
