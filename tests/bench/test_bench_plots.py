"""Benchmark figures: each writes a readable PNG, for ordinary and empty inputs."""

import random

import pytest
from PIL import Image

from headrace.bench import plots


def png_size(path) -> tuple[int, int]:
    assert path.read_bytes()[:4] == b"\x89PNG"
    return Image.open(path).size


def point(rate, p50, goodput):
    return {"rate": rate, "p50_s": p50, "p95_s": p50 * 1.8, "mean_s": p50 * 1.1, "goodput": goodput}


SERIES = {
    "fifo": [point(r, 2.0 / max(0.05, 1 - r), min(r, 0.8)) for r in (0.2, 0.5, 0.8, 1.2)],
    "all passes": [point(r, 1.5 / max(0.05, 1.6 - r), min(r, 1.4)) for r in (1.2, 0.2, 0.5, 0.8)],  # unsorted
}


@pytest.mark.parametrize("series, slo", [
    (SERIES, 10.0),
    (SERIES, None),
    ({}, 5.0),
    ({"empty mode": []}, None),
    ({"gappy": [point(1, 1.0, 1.0), {"rate": 2, "p50_s": None, "p95_s": None, "goodput": None}]}, 1.0),
])
def test_latency_vs_load(tmp_path, series, slo):
    out = tmp_path / "nested" / "latency.png"  # missing folders are made
    plots.latency_vs_load(series, out, "latency vs load", slo_s=slo)
    width, height = png_size(out)
    assert width > 800 and height > 300


def test_timeline_writes_the_daemon_gantt(tmp_path):
    timeline = {"run": "r", "workflow": "w", "seconds": 1.0, "engines": [],
                "nodes": [{"node": "n", "op": "embed", "engine": "e", "key": [], "state": "done",
                           "start": 0.0, "end": 0.5, "pieces": []}]}
    plots.timeline(timeline, tmp_path / "t.png", title="one node")
    plots.timeline({"nodes": [], "engines": []}, tmp_path / "empty.png")
    assert png_size(tmp_path / "t.png")[0] > 0 and png_size(tmp_path / "empty.png")[0] > 0


def activity(n_pairs: int, per_pair: int = 20) -> list[dict]:
    rng = random.Random(0)
    return [{"engine": f"engine{i}", "op": "decode" if i % 2 else "embed", "size": rng.randint(1, 16),
             "start": 0.0, "end": 0.1} for i in range(n_pairs) for _ in range(per_pair + i)]


def test_batch_groups_keep_the_busiest_pairs():
    groups = plots.batch_groups(activity(11))
    assert len(groups) == plots.MAX_PANELS
    assert next(iter(groups)) == ("engine10", "embed")  # most batches first
    assert plots.batch_groups([{"engine": "e", "op": "o", "size": None}]) == {}


@pytest.mark.parametrize("records", [
    activity(3),
    activity(11),
    [],
    [{"engine": "big", "op": "embed", "size": 500, "start": 0, "end": 1},
     {"engine": "big", "op": "embed", "size": 40, "start": 1, "end": 2}],  # past 64: binned histogram
])
def test_batch_sizes(tmp_path, records):
    plots.batch_sizes(records, tmp_path / "b.png", "batch sizes")
    width, height = png_size(tmp_path / "b.png")
    assert width > 0 and height > 0


@pytest.mark.parametrize("table", [
    {"all passes": 2.1, "no batching": 0.9, "topology": 1.0},
    {},
    {"nan": float("nan"), "missing": None, "ok": 1.3},
])
def test_ratios_bar(tmp_path, table):
    plots.ratios_bar(table, tmp_path / "r.png", "speedup vs fifo")
    width, height = png_size(tmp_path / "r.png")
    assert width > 0 and height > 0
