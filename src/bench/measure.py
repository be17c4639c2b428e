"""Figures derived from what the daemon reports: overhead from a run's timeline, batch sizes from /metrics."""

from __future__ import annotations

import re
from typing import Any


def busy_union(timeline: dict[str, Any]) -> float:
    """Seconds within the run during which at least one engine was computing."""
    end_of_run = timeline["seconds"]
    spans = sorted((max(0.0, b["start"]), min(end_of_run, b["end"])) for b in timeline["engines"])
    total, cur_start, cur_end = 0.0, None, None
    for s, e in spans:
        if e <= s:
            continue
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def overhead(latency_s: float, timeline: dict[str, Any]) -> dict[str, float]:
    """Where a lone run's time went outside engine compute.

    ``client_s``: HTTP, validation, graph building and optimization (client latency
    minus the executor's time); ``executor_s``: scheduling, queueing, prompt
    rendering and hand-offs inside the run (its time minus engine compute). Only
    meaningful for a run that had the engines to itself.
    """
    compute = busy_union(timeline)
    server = timeline["seconds"]
    out = latency_s - compute
    return {"e2e_s": latency_s, "server_s": server, "compute_s": compute, "overhead_s": out,
            "client_s": latency_s - server, "executor_s": server - compute, "share": out / latency_s if latency_s else 0.0}


_BUCKET = re.compile(r'^headrace_batch_size_bucket\{(?P<labels>[^}]*)\}\s+(?P<value>[0-9.e+]+)$')
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def batch_buckets(metrics_text: str) -> dict[str, dict[float, float]]:
    """``engine/op`` -> cumulative count per ``le`` bound, from the Prometheus text format."""
    out: dict[str, dict[float, float]] = {}
    for line in metrics_text.splitlines():
        m = _BUCKET.match(line)
        if m:
            labels = dict(_LABEL.findall(m["labels"]))
            le = float("inf") if labels["le"] == "+Inf" else float(labels["le"])
            out.setdefault(f"{labels['engine']}/{labels['op']}", {})[le] = float(m["value"])
    return out


def batch_sizes_between(before: str, after: str) -> list[dict[str, Any]]:
    """The batches run between two /metrics snapshots, one record per batch, sized at its bucket's bound.

    Buckets are coarse (1, 2, 4, 8, 16, ...), so a size is the bucket's upper bound; batches above the
    largest bound are recorded at twice it.
    """
    a, b = batch_buckets(before), batch_buckets(after)
    records = []
    for series, counts in b.items():
        engine, op = series.split("/", 1)
        prev_cum, prev_le = 0.0, 0.0
        for le in sorted(counts):
            cum = counts[le] - a.get(series, {}).get(le, 0.0)
            n = int(round(cum - prev_cum))
            size = le if le != float("inf") else prev_le * 2
            records += [{"engine": engine, "op": op, "size": int(size)} for _ in range(max(0, n))]
            prev_cum, prev_le = cum, le
    return records
