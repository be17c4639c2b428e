"""headrace: a single-node serving daemon for compound-AI workflows."""

import os

# Each engine runs torch on its own thread, and each such thread gets its own OpenMP team.
# libgomp's default makes idle team threads spin, burning the cores the other teams (and any
# neighbour process) need: on 2 cores with one busy neighbour, SmolLM2 prefill took 5-17x longer
# and decode ran 3-5x slower than with sleeping waiters. libgomp reads this once, when torch
# loads, so it is set on import, before any engine; an operator's own value wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
