"""How close an engine's numbers are to an independent float32 reference.

- ``reference``: Hugging Face transformers in float32 on the same GGUF file an engine serves (an implementation
  no one here wrote): log-softmax rows and greedy continuations.
- ``metrics``: per-token KL(reference || engine) in nats and top-1 agreement, summarised over many prompts, and
  how many greedy answers are identical.

Used by ``headrace check`` (a wrong kernel or build fails like a SIGILL does) and ``headrace bench quality``.
May import ``headrace.plugins`` and ``headrace.types``, never the daemon, graph, batching or bench.
"""

from headrace.quality.metrics import (QualityStats, TokenScores, compare, identical_fraction, kl_rows, summarize,
                                      top1_rows)

__all__ = ["QualityStats", "TokenScores", "compare", "identical_fraction", "kl_rows", "summarize", "top1_rows"]
