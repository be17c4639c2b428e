#!/usr/bin/env python3
"""What LanceDB's session cache holds under the soak's ingest pattern, with LanceDB's default bounds and with the
bounds headrace's store sets (``index_cache_mib``, ``metadata_cache_mib``).

One table of 192 rows (384-dim vectors, a text column with its FTS index), then ``--cycles`` cycles of what the
soak's ingests and queries do to a collection: delete a slot's 3 rows, add 3 new ones (two table versions), fold
unindexed rows into the FTS index past 64, and four vector searches. Each arm runs in a fresh process and prints
the session's bytes and items and the process's RSS every 50 cycles.

    python scripts/bench/lancedb_session_cache.py [--cycles 500] [--bound-mib 1]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def arm(path: str, cycles: int, bound_bytes: int | None) -> None:
    import lancedb
    import numpy as np
    import pyarrow as pa
    from lancedb.index import FTS

    session = (lancedb.Session() if bound_bytes is None
               else lancedb.Session(index_cache_size_bytes=bound_bytes, metadata_cache_size_bytes=bound_bytes))
    db = lancedb.connect(path, session=session)
    rng = np.random.default_rng(0)

    def rows(ids: list[str]) -> pa.Table:
        vectors = rng.standard_normal((len(ids), 384)).astype(np.float32)
        return pa.table({"id": ids, "text": [f"passage {i} about water mills and rivers " * 20 for i in ids],
                         "vector": pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), 384)})

    table = db.create_table("c", data=rows([f"doc-{i}" for i in range(192)]))
    table.create_index("text", config=FTS(), replace=True)
    start = time.perf_counter()
    for cycle in range(cycles + 1):
        if cycle % 50 == 0:
            print(json.dumps({"cycle": cycle, "versions": table.version, "session_kib": session.size_bytes >> 10,
                              "items": session.approx_num_items, "rss_mib": round(rss_mib(), 1),
                              "seconds": round(time.perf_counter() - start, 1)}), flush=True)
        if cycle == cycles:
            break
        ids = [f"slot-{cycle % 8}-{j}" for j in range(3)]
        table.delete("id IN (" + ", ".join(f"'{i}'" for i in ids) + ")")
        table.add(rows(ids))
        stats = table.index_stats(table.list_indices()[0].name)
        if stats is not None and stats.num_unindexed_rows >= 64:
            table.optimize()
        for _ in range(4):
            (table.search(rng.standard_normal(384).astype(np.float32), vector_column_name="vector")
             .distance_type("cosine").limit(3).to_list())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=500)
    p.add_argument("--bound-mib", type=int, default=1, help="the bounded arm's index and metadata cache, MiB")
    p.add_argument("--arm", choices=["default", "bounded"], help=argparse.SUPPRESS)  # one arm, in this process
    p.add_argument("--path", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.arm:
        arm(args.path, args.cycles, None if args.arm == "default" else args.bound_mib << 20)
        return
    for name in ("default", "bounded"):
        print(f"== {name}" + ("" if name == "default" else f": {args.bound_mib} MiB each"), flush=True)
        with tempfile.TemporaryDirectory() as path:
            subprocess.run([sys.executable, __file__, "--arm", name, "--path", path, "--cycles", str(args.cycles),
                            "--bound-mib", str(args.bound_mib)], check=True)


if __name__ == "__main__":
    main()
