"""Sliding-window attention (Gemma 3, and any model whose GGUF gives llama.cpp an ``n_swa``) on the llama.cpp engine.

llama.cpp keeps a window model's KV in two caches: the full-attention layers' (every position) and the window
layers' (``swa_full = false``: ``n_swa`` positions plus a ubatch's, per stream; older cells are overwritten once
masked). A continuation at position ``n`` needs, in the window layers, every position from ``n - n_swa + 1``
(a query attends keys less than ``n_swa`` behind it). A context continued at its end always has them (llama.cpp
overwrites only cells its own last position masks), so a fork is always right. What reuses a *prefix* of a
longer context (a prefix-cache hit trimmed to a block boundary, a tier restore trimmed the same way) may find
those positions gone: llama-server then reprocesses the prompt (its ``llama_memory_seq_pos_min`` check), or keeps
the whole window (``--swa-full``, llama.cpp#14157).

Here both: ``swa_full = "auto"`` keeps the whole window while the prefix cache is on (every reuse is then served;
the memory it costs is in docs/engines.md), the window only when it is off (forks alone reuse KV, and need no more);
and every reuse is checked (``window_holds``), so one the window no longer covers is refused and the prompt
prefilled whole, counted as a cache miss: never a wrong answer, whatever ``swa_full`` says.
"""

from __future__ import annotations

import logging
from typing import Any

from headrace.plugins.engines.llama_cpp.files import llama

log = logging.getLogger("headrace.plugins.engines.llama_cpp")


def window_of(model: Any) -> int:
    """The model's attention window (0: full attention on every layer)."""
    return max(0, int(llama().llama_model_n_swa(model)))


def full_window(option: bool | None, window: int, prefix_cache: bool, name: str) -> bool:
    """``swa_full`` for a context: the option as set, or (None: auto) the whole window while a prefix cache may
    reuse prefixes of longer contexts. One log line says which, for a window model."""
    full = option if option is not None else prefix_cache
    if window:
        why = "as configured" if option is not None else \
            ("auto: the prefix cache reuses prefixes older than the window" if full
             else "auto: no prefix cache, forks continue a context where the window holds")
        log.info("engine %s: a %d-token sliding window; its layers keep %s (swa_full %s, %s)", name, window,
                 "every position" if full else "the window only", str(full).lower(), why)
    return full


def window_holds(mem: Any, seq: int, n: int, window: int) -> bool:
    """Whether sequence ``seq``, holding positions up to ``n - 1``, serves a continuation at ``n``: its window
    layers hold every position from ``n - window + 1`` (llama.cpp keeps ``[pos_min, pos_max]`` whole; the full
    layers are a superset)."""
    if window <= 0 or n <= 0:
        return True
    pos_min = llama().llama_memory_seq_pos_min(mem, seq)
    return 0 <= pos_min <= max(0, n - window + 1)


__all__ = ["window_of", "full_window", "window_holds"]
