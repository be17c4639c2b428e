#!/usr/bin/env python3
"""What a process boundary would cost an LLM engine core per iteration: the parent sends one step's output
(16 rows' token ids, logprobs, finish flags) through a ``multiprocessing.Pipe`` (pickled) and the child
sends it back, as a core in a child process would exchange its step and the next commands.

    python scripts/bench/ipc_roundtrip.py [TRIPS]      (default 20,000; prints microseconds per round trip)
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
from multiprocessing.connection import Connection


def echo(conn: Connection) -> None:
    while (msg := conn.recv()) is not None:
        conn.send(msg)


def main() -> None:
    trips = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    parent, child = mp.Pipe()
    proc = mp.Process(target=echo, args=(child,))
    proc.start()
    step = {"tokens": list(range(16)), "logprobs": [0.1] * 16, "finished": [False] * 16}
    for _ in range(1000):  # warm-up
        parent.send(step)
        parent.recv()
    t0 = time.perf_counter()
    for _ in range(trips):
        parent.send(step)
        parent.recv()
    seconds = time.perf_counter() - t0
    parent.send(None)
    proc.join()
    print(f"{seconds / trips * 1e6:.1f} us per round trip ({trips} trips)")


if __name__ == "__main__":
    main()
