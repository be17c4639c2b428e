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

    transformers.utils.logging.disable_progress_bar()
    # transformers logs its deprecations and advice at WARNING through its own handler.
    transformers.utils.logging.set_verbosity_error()
    try:
        from huggingface_hub.utils import disable_progress_bars
    except ImportError:
        return
    disable_progress_bars()
