#!/usr/bin/env python3
"""What the kept run history costs in memory: a daemon's RSS after N `naive_rag` runs over long documents,
with `[workflows] keep_runs` at its default (every run kept), at 1 (none kept), and with the default count but
`run_history_mib = 1` (every run kept, its details dropped past a MiB), one daemon after the other.

    python scripts/bench/run_history_memory.py [--runs 60] [--doc-tokens 2000] [--config configs/default.toml]

Prints the RSS after a warm-up and after the runs, for each setting; the difference between the two growths,
divided by the runs, is what one kept run holds.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
PARAGRAPH = ("The headrace is the channel that carries water from the river to the mill wheel; the tailrace "
             "carries it back. Millers kept the channel clear of silt and leaves so the wheel turned evenly. ")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(config: Path, overrides: dict[str, str], runs: int, doc_words: int) -> tuple[float, float]:
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **overrides}
    with tempfile.TemporaryDirectory() as data:
        proc = subprocess.Popen([sys.executable, "-m", "headrace.daemon.commands", "serve", "--config", str(config),
                                 "--port", str(port), "--data-dir", data, "--log-level", "warning"], env=env)
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                try:
                    if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1)
            words = PARAGRAPH.split()
            docs = [" ".join((words * (doc_words // len(words) + 1))[i:i + doc_words]) for i in range(4)]

            def one(i: int) -> None:
                body = {"inputs": {"question": f"What does the headrace carry? ({i})", "documents": docs},
                        "config": {"max_tokens": 8}}
                r = httpx.post(f"{base}/v1/workflows/naive_rag/runs", json=body, timeout=300)
                assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text[:300]

            for i in range(5):
                one(i)
            before = rss_mib(proc.pid)
            for i in range(runs):
                one(100 + i)
            return before, rss_mib(proc.pid)
        finally:
            proc.terminate()
            proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--doc-tokens", type=int, default=2000, help="about this many words per document")
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "default.toml")
    args = ap.parse_args()
    settings = (("keep_runs default", {}), ("keep_runs 1", {"HEADRACE_WORKFLOWS_KEEP_RUNS": "1"}),
                ("run_history_mib 1", {"HEADRACE_WORKFLOWS_RUN_HISTORY_MIB": "1"}))
    for label, overrides in settings:
        before, after = measure(args.config, overrides, args.runs, args.doc_tokens)
        print(f"{label:18} RSS {before:8.1f} MiB after the warm-up, {after:8.1f} after {args.runs} runs: "
              f"+{after - before:.1f} MiB ({(after - before) / args.runs * 1024:.0f} KiB a run)", flush=True)


if __name__ == "__main__":
    main()
