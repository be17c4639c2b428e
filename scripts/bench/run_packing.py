#!/usr/bin/env python3
"""What a finished run holds in memory live and packed (``headrace.graph.run_history``): the bench workloads'
``naive_rag`` and ``map_reduce_summary`` over the bench corpus, run in-process on a config's engines.

Each run is measured (``retained_bytes``, the run history's own measure) as it finishes, then packed as the
history packs the runs older than its newest 32, and measured again.

    python scripts/bench/run_packing.py [--runs 3] [--config configs/default.toml]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="runs of each workflow")
    p.add_argument("--config", default=str(ROOT / "configs" / "default.toml"))
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from starlette.testclient import TestClient

    from headrace.bench.corpus import build_corpus
    from headrace.bench.workloads import WORKLOADS
    from headrace.daemon.app import create_app
    from headrace.daemon.config import load_config
    from headrace.graph.run_history import pack, retained_bytes

    corpus = build_corpus()
    with tempfile.TemporaryDirectory() as data:
        config = load_config(Path(args.config), env={}, overrides={"data.dir": data, "server.api_key": ""})
        app = create_app(config)
        with TestClient(app) as client:
            while client.get("/ready").status_code != 200:
                time.sleep(1)
            service = app.state.services.daemon.workflows
            service.history.live_finished = 1 << 30  # this script packs each run itself
            print(f"{'workflow':<20} {'live KiB':>9} {'packed KiB':>11} {'of it JSON':>11}")
            for name in ("naive_rag", "map_reduce_summary"):
                for i in range(args.runs):
                    body = {"inputs": WORKLOADS[name].inputs(corpus, i), "config": dict(WORKLOADS[name].config)}
                    response = client.post(f"/v1/workflows/{name}/runs", json=body)
                    if response.status_code != 200 or response.json()["status"] != "succeeded":
                        sys.exit(f"{name}: HTTP {response.status_code}: {response.text[:300]}")
                    run = service.runs[response.json()["id"]]
                    live = retained_bytes(run)
                    pack(run)
                    print(f"{name:<20} {live / 1024:>9.1f} {retained_bytes(run) / 1024:>11.1f} "
                          f"{len(run.packed) / 1024:>11.1f}", flush=True)


if __name__ == "__main__":
    main()
