"""The ``sglang`` engine's options (SGLang's own ``ServerArgs``) and its sampling parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headrace.plugins.api import (Detokenizer, JsonSchemaConstraint, LarkConstraint, SamplingParams, is_greedy,
                                  json_schema_text)

DTYPES = ("auto", "bfloat16", "float16", "float32")
# ServerArgs the plugin sets itself: the protocol depends on them.
MANAGED_SERVER_ARGS = frozenset({
    "model_path", "tokenizer_path", "incremental_streaming_output", "enable_priority_scheduling",
    "schedule_low_priority_values_first", "skip_tokenizer_init", "tokenizer_worker_num", "log_level",
    "grammar_backend",
})
# Constrained decoding through llguidance, as the built-in engines do: headrace's grammars are in
# its Lark dialect (tool calls embed JSON schemas with %json), which SGLang's xgrammar default cannot read.
GRAMMAR_BACKEND = "llguidance"


@dataclass(frozen=True)
class SGLangOptions:
    """``engines.<name>.options`` of an ``sglang`` engine; the names are SGLang's own ``ServerArgs``."""

    dtype: str = "bfloat16"
    context_length: int | None = None  # tokens a context holds (prompt and output); None: the model's
    mem_fraction_static: float | None = None  # GPU memory for weights and KV cache; None: SGLang sizes it
    max_running_requests: int | None = None  # requests decoding at once; None: SGLang's
    page_size: int | None = None  # KV page tokens: the radix cache shares whole pages; None: SGLang's
    chunked_prefill_size: int | None = None  # prefill chunk tokens (-1: no chunking); None: SGLang's
    attention_backend: str | None = None  # e.g. "fa3", "flashinfer", "triton"; None: SGLang's choice
    # Batch-invariant kernels: output does not depend on what else is batched, and seeds are honoured.
    enable_deterministic_inference: bool = False
    tp_size: int = 1  # GPUs the model is split over
    server_args: dict[str, Any] = field(default_factory=dict)  # any other ServerArgs field, as is

    @classmethod
    def parse(cls, name: str, options: dict[str, Any]) -> "SGLangOptions":
        key = f"engines.{name}.options"
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"{key}: unknown option(s) {unknown}; known: {sorted(known)}")
        opts = cls(**options)
        if opts.dtype not in DTYPES:
            raise ValueError(f"{key}.dtype: unknown dtype {opts.dtype!r}; choose one of {list(DTYPES)}")
        for attr, least in (("context_length", 2), ("max_running_requests", 1), ("page_size", 1)):
            value = getattr(opts, attr)
            if value is not None and (not _is_int(value) or value < least):
                raise ValueError(f"{key}.{attr} must be an integer >= {least}")
        if not _is_int(opts.tp_size) or opts.tp_size < 1:
            raise ValueError(f"{key}.tp_size must be an integer >= 1")
        chunk = opts.chunked_prefill_size
        if chunk is not None and (not _is_int(chunk) or (chunk < 1 and chunk != -1)):
            raise ValueError(f"{key}.chunked_prefill_size must be an integer >= 1, or -1 for no chunking")
        fraction = opts.mem_fraction_static
        if fraction is not None and not (
            isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and math.isfinite(fraction)
            and 0 < fraction < 1
        ):
            raise ValueError(f"{key}.mem_fraction_static must be a number in (0, 1)")
        if opts.attention_backend is not None and not (isinstance(opts.attention_backend, str)
                                                       and opts.attention_backend):
            raise ValueError(f"{key}.attention_backend must be a backend name")
        if not isinstance(opts.enable_deterministic_inference, bool):
            raise ValueError(f"{key}.enable_deterministic_inference must be true or false")
        if not isinstance(opts.server_args, dict) or not all(isinstance(k, str) for k in opts.server_args):
            raise ValueError(f"{key}.server_args must be a table of SGLang ServerArgs fields")
        typed = sorted(set(opts.server_args) & (known - {"server_args"}))
        if typed:
            raise ValueError(f"{key}.server_args: set {typed} as options of their own ({key}.{typed[0]})")
        managed = sorted(set(opts.server_args) & MANAGED_SERVER_ARGS)
        if managed:
            raise ValueError(f"{key}.server_args: the plugin sets {managed} itself")
        return opts

    def engine_kwargs(self, model_dir: Path) -> dict[str, Any]:
        """The keyword arguments of ``sglang.Engine`` (its ``ServerArgs``)."""
        kwargs: dict[str, Any] = dict(
            model_path=str(model_dir),
            tokenizer_path=str(model_dir),
            dtype=self.dtype,
            tp_size=self.tp_size,
            enable_deterministic_inference=self.enable_deterministic_inference,
            # Streamed outputs are deltas (text and token ids), not the whole text so far.
            incremental_streaming_output=True,
            # headrace's order, as vLLM's: lower values run first.
            enable_priority_scheduling=True,
            schedule_low_priority_values_first=True,
            grammar_backend=GRAMMAR_BACKEND,
        )
        for attr in ("context_length", "mem_fraction_static", "max_running_requests", "page_size",
                     "chunked_prefill_size", "attention_backend"):
            if getattr(self, attr) is not None:
                kwargs[attr] = getattr(self, attr)
        kwargs.update(self.server_args)
        return kwargs


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def sampling_params(params: SamplingParams, max_new_tokens: int) -> dict[str, Any]:
    """SGLang's sampling parameters for a decode (stop strings are applied here, see ``StopText``)."""
    sampling: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": 0.0 if is_greedy(params) else params.temperature,
        "top_p": params.top_p,
    }
    if params.seed is not None:
        sampling["sampling_seed"] = _int64(params.seed)  # honoured with enable_deterministic_inference
    constraint = params.constraint
    if isinstance(constraint, JsonSchemaConstraint):
        sampling["json_schema"] = json_schema_text(constraint)
    elif isinstance(constraint, LarkConstraint):
        sampling["ebnf"] = constraint.grammar  # the llguidance backend reads Lark as its "ebnf"
    return sampling


class StopText(Detokenizer):
    """Stop strings on text SGLang has already detokenized, as headrace's Detokenizer applies them:
    text that could still become a stop string is held back, and the earliest stop ends the output.

    SGLang's own stop strings are not used: it streams the first tokens of a stop string before the
    last one matches, and trims the match from its text only at the end.
    """

    def add_text(self, delta: str) -> tuple[str, bool]:
        """Append SGLang's new text; return (text to emit, whether a stop string ended it)."""
        self.text += delta
        return self._take()


def _int64(seed: int) -> int:
    """SGLang takes signed 64-bit seeds; headrace also admits the unsigned ones, which wrap around."""
    return seed - 2**64 if seed >= 2**63 else seed

