"""The public API for headrace plugins: everything an engine plugin needs, in one module.

A plugin imports from here and from ``headrace.plugins.hookspecs`` (``hookimpl``), nothing else of
headrace's: the modules behind these names may move, these names stay. ``docs/plugins.md`` explains
each group and how an engine plugin is written.

- **Declaring an engine**: ``EngineSpec`` (its config table), ``EngineEnv`` (what the daemon lends it),
  the protocols it meets (``LLMEngine``, ``EmbedEngine``, ...) and their value types.
- **An in-process LLM engine**: ``LLMFront`` (the event-loop half, which serves the ``LLMEngine``
  protocol) over a subclass of ``LLMCore`` (the worker-thread half: the model, its KV and batches),
  with the commands they exchange (``TokenListCore`` and ``Hold`` for a core over an engine that takes whole
  token lists and caches prefixes itself, as vLLM and SGLang do); ``EngineError`` is the error every LLM engine raises (``EngineFailed``, raised
  by a core's iteration, fails the whole engine).
- **Helpers**: token checks, sampling (``Detokenizer``, ``is_greedy``), chat templates, output
  constraints, model files (``resolve_model``, ``convert_gguf``).
- **Hosting the daemon** (a plugin that runs whole daemons, as headrace-ray does): ``create_app``,
  ``load_config``, ``default_config_path``, ``APIError``. They live in the daemon layer, above this
  one, and layers import only downward: so they are resolved on first use (module ``__getattr__``),
  and importing this module never imports the daemon.
"""

from __future__ import annotations

import importlib
from typing import Any

from headrace.plugins.engines.llm.chat import ChatMessages, ToolSpecs, apply_template
from headrace.plugins.engines.llm.constraints import json_schema_text
from headrace.plugins.engines.llm.core import LLMCore, Row, prefill_answer, sample_row, sample_rows
from headrace.plugins.engines.llm.front import LLMFront
from headrace.plugins.engines.llm.messages import (CacheControl, Command, Decode, EngineError, EngineFailed, Heartbeat,
                                                   Logits, Outbox, Prefill, Reply, Stop)
from headrace.plugins.engines.llm.prompt_scores import PromptScorer, PromptScoring
from headrace.plugins.engines.llm.request_checks import check_token_ids
from headrace.plugins.engines.llm.sampling import LOGPROB_FLOOR, Detokenizer, is_greedy
from headrace.plugins.engines.llm.token_lists import Hold, TokenListCore, safetensors_model
from headrace.plugins.engines.models.loading import auto_dtype, convert_gguf
from headrace.plugins.engines.models.paths import ModelNotFound, resolve_model
from headrace.plugins.protocols import (EmbedEngine, Engine, EngineEnv, EngineKind, EngineSpec, FinishReason,
                                        JsonSchemaConstraint, LarkConstraint, LLMEngine, OutputConstraint,
                                        PromptLogprobs, RerankEngine, SamplingParams, ScoresPrompts,
                                        ScoresThroughCache, SearchHit, TokenDelta, TokenLogprob, VectorStore,
                                        WarmsDocuments)
from headrace.types import ContextId, TokenIds

# Hosting names -> the daemon module that defines each (resolved lazily, see the module docstring).
_HOSTING = {
    "create_app": "headrace.daemon.app",
    "load_config": "headrace.daemon.config",
    "default_config_path": "headrace.daemon.config",
    "APIError": "headrace.daemon.errors",
}

__all__ = [
    # declaring an engine
    "Engine", "EngineKind", "EngineSpec", "EngineEnv", "LLMEngine", "EmbedEngine", "RerankEngine", "VectorStore",
    "SamplingParams", "TokenDelta", "TokenLogprob", "FinishReason", "SearchHit", "ContextId", "TokenIds",
    "OutputConstraint", "JsonSchemaConstraint", "LarkConstraint", "ScoresPrompts", "PromptLogprobs",
    "ScoresThroughCache", "WarmsDocuments",
    # an in-process LLM engine
    "EngineError", "EngineFailed", "LLMFront", "LLMCore", "Row", "sample_rows", "sample_row", "prefill_answer",
    "Command", "Prefill", "Decode", "Stop", "Logits", "CacheControl", "Heartbeat", "Reply", "Outbox",
    "TokenListCore", "Hold", "PromptScoring", "PromptScorer",
    # helpers
    "check_token_ids", "Detokenizer", "is_greedy", "LOGPROB_FLOOR", "ChatMessages", "ToolSpecs", "apply_template",
    "json_schema_text", "resolve_model", "ModelNotFound", "convert_gguf", "safetensors_model", "auto_dtype",
    # hosting the daemon
    *_HOSTING,
]


def __getattr__(name: str) -> Any:
    module = _HOSTING.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once
    return value
