"""Client-side baselines: the same pipelines as headrace's workflows, run as clients of the same daemon.

Each baseline imports its peer library (LlamaIndex, the openai SDK) lazily through
:func:`require`, so importing ``headrace.bench`` never needs them; a baseline whose
peer is missing raises :class:`MissingPeer` when it is built, never falls back.
"""

from __future__ import annotations

import importlib
from types import ModuleType

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


__all__ = ["MissingPeer", "require"]
