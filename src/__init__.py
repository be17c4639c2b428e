"""headrace: a single-node serving daemon for compound-AI workflows."""

import os

# OpenMP waiters spin for a bounded time (libgomp's GOMP_SPINCOUNT 300,000: about 3 ms), then sleep.
# llama.cpp's CPU backend shares torch's libgomp in this process, and one decode step is a few hundred
# OpenMP barriers: with sleeping waiters (OMP_WAIT_POLICY=PASSIVE, this package's earlier choice) each
# is a futex wake-up, and the llama-cpp engine decoded one stream at 0.93x llama-server's rate, 16 at
# 0.81x; with a 3 ms spin 1.40x and 0.96x, and an idle daemon still uses no CPU (docs/engines.md).
# ACTIVE alone would spin for minutes. libgomp reads both once, when torch or llama.cpp loads, so they
# are set on import, before any engine; an operator who sets either keeps their own wait behaviour
# (PASSIVE suits torch engines beside a busy neighbour process).
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
    os.environ["GOMP_SPINCOUNT"] = "300000"

__version__ = "0.1.0"
