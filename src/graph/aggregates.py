"""ALTO's aggregation operators: what an aggregate node makes of the pieces of one key."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from headrace.graph.ops import NodeError


def aggregate(op: str, parts: list[Any], params: Mapping[str, Any]) -> Any:
    """ALTO's aggregation operators over the pieces of one key, in piece order."""
    if op == "concat":
        out: list[Any] = []
        for p in parts:
            if isinstance(p, torch.Tensor):
                return torch.cat([q for q in parts if q.numel()])
            out.extend(p if isinstance(p, list) else [p])
        return list(dict.fromkeys(out)) if params.get("dedupe") and all(isinstance(x, str) for x in out) else out
    if op == "last":
        return parts[-1]
    if op == "sum":
        return sum(parts)
    if op == "count":
        return len(parts)
    if op == "topk":
        items = [x for p in parts for x in (p if isinstance(p, list) else [p])]
        # sorted is stable, so equal scores keep part order, as one unsplit ranking would.
        best = sorted(items, key=lambda x: x[0], reverse=True)[: params.get("k", 3)]
        return [value for _, value in best] if params.get("values") else best
    if op == "filter":
        return [p for p in parts if params["keep"](p)]
    raise NodeError(f"unknown aggregate op {op!r}")
