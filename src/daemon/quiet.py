"""Keep the libraries' own output out of the daemon's log: progress bars and warnings meant for developers.

transformers and huggingface_hub draw tqdm bars while a model loads (a GGUF's conversion,
checkpoint shards), and torch, transformers and friends raise FutureWarnings and
deprecation warnings about their own APIs that an operator can do nothing about. The
log says what the daemon does instead: one line per engine as it loads. Other warnings
still reach the log, each as one line through the logging system.
"""

from __future__ import annotations

import logging
import os
import warnings

# Library warnings about the libraries' APIs: for whoever writes the code, not whoever runs it.
SILENCED = (FutureWarning, DeprecationWarning, PendingDeprecationWarning)


def quiet_libraries() -> None:
    """Call before any model loads (the CLI's commands do, before they build engines)."""
    # Read by huggingface_hub (and transformers through it) when they import: set before that.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    for category in SILENCED:
        warnings.filterwarnings("ignore", category=category)
    logging.captureWarnings(True)  # what is left arrives as one log line, not a two-line stderr dump

    import transformers

    # Also switches huggingface_hub's bars off.
    transformers.utils.logging.disable_progress_bar()
    # transformers logs its deprecations and advice at WARNING through a stderr handler of its own.
    transformers.utils.logging.set_verbosity_error()
    # Its GGUF loader draws a bare tqdm bar that ignores the switch above (and tqdm's own
    # TQDM_DISABLE is read when tqdm is imported, which torch has done by now): hand it
    # transformers' switchable bar instead.
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_loader
    except ImportError:  # no gguf package: no GGUF loads either
        return
    if hasattr(gguf_loader, "tqdm"):
        gguf_loader.tqdm = transformers.utils.logging.tqdm
