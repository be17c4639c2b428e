"""Client-side baselines: the same pipelines as headrace's workflows, run as clients of the same daemon.

Each baseline imports its peer library (LlamaIndex, the openai SDK) lazily through
:func:`require`, so importing ``headrace.bench`` never needs them; a baseline whose
peer is missing raises :class:`MissingPeer` when it is built, never falls back.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Mapping

EXTRA = "pip install 'headrace[bench]'"


class MissingPeer(RuntimeError):
    """A baseline's peer library is not installed (or does not import)."""


def require(module: str, extra_pip: str, what: str) -> ModuleType:
    """Import ``module`` for ``what``; a missing one raises MissingPeer naming the pip package ``extra_pip``.

    >>> require("llama_index.core", "llama-index-core", "the LlamaIndex baseline")  # doctest: +SKIP
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingPeer(f"{what} needs {extra_pip} ({EXTRA}); importing {module!r} failed: {exc}") from exc


def client_validate(what: str, workflows: Mapping[str, Any], workflow: str, inputs: Any,
                    config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """headrace's own validation and defaults for a baseline; server-side settings have no meaning for a client."""
    from headrace.graph.workflow import COMMON_CONFIG

    if workflow not in workflows:
        raise ValueError(f"{what} runs {sorted(workflows)}, not {workflow!r}")
    for key in COMMON_CONFIG:
        if isinstance(config, dict) and key in config:
            raise ValueError(f"config.{key}: a server-side setting; a client baseline has none")
    inputs, config = workflows[workflow].validate(inputs, config)
    for key in COMMON_CONFIG:
        config.pop(key, None)
    return inputs, config


__all__ = ["MissingPeer", "client_validate", "require"]
