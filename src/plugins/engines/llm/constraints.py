"""Constrained decoding for the in-process engines, with llguidance.

A request's ``OutputConstraint`` (a JSON schema or a Lark grammar) becomes an llguidance
``LLMatcher`` per decoding row. Each step the row's matcher gives a bitmask of the tokens
the grammar allows next; the shared sampler masks the rest out before greedy or random
sampling, and the sampled token advances the matcher. When the grammar is complete only
EOS is allowed, so a constrained row ends with finish_reason "stop".

llguidance rather than xgrammar or outlines: it is vLLM's ``guidance`` backend (the vLLM
plugin maps the same constraint onto it, so the grammar dialect is one), it builds a
tokenizer straight from a Hugging Face fast tokenizer (both built-in engines have one), it
computes a mask in tens of microseconds without a per-schema precompile step, and its Lark
syntax embeds JSON schemas (``%json``), which the tool-call grammars need.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Iterable, Sequence

import llguidance
import llguidance.hf
import torch

from headrace.plugins.protocols import JsonSchemaConstraint, LarkConstraint, OutputConstraint

# Compact JSON with the separators of Python's json.dumps, which small models write most
# naturally; no free whitespace, so a weak model cannot stall in a run of blanks.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHED_GRAMMARS = 64  # compiled constraints an engine keeps (LRU)


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists ``properties`` and says nothing
    about others.

    What this admits is a subset of what the schema admits, so the output still matches it; but a
    small model left free to add keys never stops adding them (vLLM's ``disable_additional_properties``).
    ``allOf`` members are left alone: each may list only part of the properties.
    """
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: closed_objects(v) for k, v in out["properties"].items()}
        out.setdefault("additionalProperties", False)
    for key in ("items", "additionalProperties", "not", "contains", "if", "then", "else"):
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in ("anyOf", "oneOf", "prefixItems", "items"):
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in ("$defs", "definitions", "patternProperties"):
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_objects(v) for k, v in out[key].items()}
    return out


def json_schema_text(constraint: JsonSchemaConstraint) -> str:
    """The schema as every engine enforces it: objects closed (``closed_objects``), and headrace's JSON layout
    (``JSON_OPTIONS``) as llguidance's ``x-guidance`` options, so an engine that compiles schemas itself (vLLM,
    SGLang with llguidance) writes the same JSON as the built-in ones."""
    schema = closed_objects(json.loads(constraint.schema))
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}
    return json.dumps(schema, ensure_ascii=False)


class ConstraintError(ValueError):
    """A constraint llguidance cannot compile (an invalid or unsupported schema or grammar)."""


def grammar_of(constraint: OutputConstraint) -> str:
    """The llguidance grammar of a constraint (not yet checked)."""
    if isinstance(constraint, JsonSchemaConstraint):
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(json_schema_text(constraint), defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise ConstraintError(str(exc)) from None
    if isinstance(constraint, LarkConstraint):
        return llguidance.LLMatcher.grammar_from_lark(constraint.grammar)
    raise TypeError(f"not an output constraint: {constraint!r}")


def check(constraint: OutputConstraint) -> None:
    """Raise ConstraintError when the constraint cannot be compiled (any tokenizer's view)."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_of(constraint))
    if is_error:
        raise ConstraintError(messages[0] if messages else "invalid grammar")


class Constrainer:
    """One engine's compiled constraints: a fresh matcher per row, compiled once per constraint.

    Lives on the engine's worker thread (the lock only guards the cache should another thread
    ask too). The llguidance tokenizer is built on first use: about a second, once per engine.
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos: Iterable[int]) -> None:
        self._hf_tokenizer = hf_tokenizer
        self._vocab_size = vocab_size  # the logits' width, which may exceed the tokenizer's
        self._eos = sorted(eos)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[OutputConstraint, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self._vocab_size,
                                                           eos_token=self._eos or None)
        return self._tokenizer

    def matcher(self, constraint: OutputConstraint) -> llguidance.LLMatcher:
        """A matcher at the start of the constraint's grammar; ConstraintError when it does not compile."""
        with self._lock:
            compiled = self._compiled.get(constraint)
            if compiled is None:
                compiled = llguidance.LLMatcher(self.tokenizer(), grammar_of(constraint), log_level=0)
                if compiled.is_error():
                    raise ConstraintError(compiled.get_error())
                self._compiled[constraint] = compiled
                if len(self._compiled) > CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(constraint)
            return compiled.deep_copy()


def bitmask(matchers: Sequence[llguidance.LLMatcher | None], vocab_size: int) -> torch.Tensor | None:
    """The allowed-token bitmask of each row, (rows, ceil(vocab/32)) int32 (all ones for a free row); None when
    no row is constrained."""
    if all(m is None for m in matchers):
        return None
    # What llguidance.torch's helpers do, written out: that module imports torch._dynamo, seconds of
    # start-up for every process that loads the engines, for two lines.
    mask = torch.full((len(matchers), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    for i, m in enumerate(matchers):
        if m is not None:
            row = mask[i]
            m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
    return mask


def advance(matcher: llguidance.LLMatcher, token: int) -> None:
    """Feed a sampled token to the row's matcher; ConstraintError if the grammar cannot take it."""
    if not matcher.consume_token(token) or matcher.is_error():
        raise ConstraintError(f"the output left its constraint: {matcher.get_error() or f'token {token}'}")
