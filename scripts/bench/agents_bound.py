#!/usr/bin/env python3
"""What ordering alone could win on the agents benchmark: an M/G/1 bound (src/bench/queueing.py).

    python scripts/bench/agents_bound.py [--size full] [--turn-seconds S] [--loads 0.5 0.7 0.9] [--out FILE]

A program's size is its turns (the benchmark's heavy-tailed draw over the size's range), each costing
the engine ``--turn-seconds`` (one over the capacity probe's turns per second, which `headrace bench
agents` reports); its tools (the size's log-uniform range, one per turn but the last) add time that no
policy changes. Per load, the mean job time under processor sharing (what per-request serving with
continuous batching does), program-level FCFS, and SRPT (which knows every program's size: the best any
order can do for the mean), and what SRPT wins over processor sharing. The agents benchmark's
`per-request` mode is set against the PS column; issue 28's target for `program-aware` is 2x its job mean.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from headrace.bench.agents import SHAPES, turn_weights
from headrace.bench.queueing import mean_responses, squared_cv


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=list(SHAPES), default="full")
    ap.add_argument("--turn-seconds", type=float, default=1.269,
                    help="engine time a turn costs, 1 / the capacity's turns per second (default: 1 / 0.788, the "
                         "probe of docs/benchmarks.md's agents run)")
    ap.add_argument("--loads", type=float, nargs="+", default=[0.5, 0.7, 0.9], help="utilisations, each in (0, 1)")
    ap.add_argument("--out", type=Path, help="also write the figures here as JSON")
    args = ap.parse_args()
    if args.turn_seconds <= 0 or any(not 0 < x < 1 for x in args.loads):
        ap.error("--turn-seconds must be > 0 and every --loads value in (0, 1)")
    shape = SHAPES[args.size]
    sizes = {float(n): p for n, p in turn_weights(shape).items()}
    turns = sum(n * p for n, p in sizes.items())
    lo, hi = shape.tool_s
    tools = (turns - 1) * (hi - lo) / math.log(hi / lo)  # log-uniform tools, one per turn but the last
    print(f"agents size {shape.name}: turns {shape.turns[0]}-{shape.turns[1]}, mean {turns:.2f}, squared CV "
          f"{squared_cv(sizes):.2f}; tools {tools:.2f} s a job; a turn {args.turn_seconds:.3f} s of engine time")
    print("| load | PS job mean | program FCFS | SRPT (best order) | PS / SRPT, job | PS / SRPT, engine part |")
    print("|---|---|---|---|---|---|")
    rows = []
    for load in args.loads:
        r = mean_responses(sizes, load)
        job = {k: getattr(r, k) * args.turn_seconds + tools for k in ("ps", "fcfs", "srpt")}
        rows.append({"load": load, **{f"{k}_job_s": v for k, v in job.items()},
                     "ps_over_srpt_job": job["ps"] / job["srpt"], "ps_over_srpt_engine": r.ps / r.srpt})
        print(f"| {load:g} | {job['ps']:.2f} s | {job['fcfs']:.2f} s | {job['srpt']:.2f} s | "
              f"{job['ps'] / job['srpt']:.2f}x | {r.ps / r.srpt:.2f}x |")
    if args.out:
        args.out.write_text(json.dumps({"size": shape.name, "mean_turns": turns, "squared_cv": squared_cv(sizes),
                                        "tools_s": tools, "turn_seconds": args.turn_seconds, "loads": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
