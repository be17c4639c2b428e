"""The critical-path bound, overhead and load statistics, on hand-built timelines."""

import pytest

from headrace.bench.critical_path import critical_path, engine_bound
from headrace.bench.load import arrivals, percentile
from headrace.bench.measure import batch_sizes_between, busy_union, overhead


def graph(edges, regions=None):
    names = sorted({n for e in edges for n in e})
    return {"nodes": [{"id": n, "region": (regions or {}).get(n)} for n in names],
            "edges": [{"src": a, "dst": b, "var": None, "stream": False} for a, b in edges]}


def rec(node, start, end, key=(), pieces=(), op="op", engine="e"):
    return {"node": node, "key": list(key), "start": start, "end": end, "pieces": list(pieces), "op": op,
            "engine": engine, "state": "done"}


def test_diamond_takes_the_longer_branch():
    # a -> (b | c) -> d; isolated runs are serial, so the timeline's own order is not the bound.
    g = graph([("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
    nodes = [rec("a", 0, 1), rec("b", 1, 3), rec("c", 3, 8), rec("d", 8, 9)]
    cp = critical_path(g, nodes)
    assert cp.seconds == pytest.approx(1 + 5 + 1)
    assert [s.node for s in cp.path] == ["a", "c", "d"]
    assert cp.compute_seconds == pytest.approx(9)
    assert [s.start for s in cp.path] == pytest.approx([0, 1, 6])


def test_streamed_region_starts_at_each_piece():
    # A partial decode parses piece 0 at 1 s and piece 1 at 2 s into its 4 s run; each piece's
    # embed (0.5 s) can start then, and the aggregate waits for both pieces and the decode.
    g = graph([("prefill", "decode"), ("decode", "embed"), ("embed", "agg"), ("decode", "agg")],
              regions={"embed": "decode"})
    nodes = [rec("prefill", 0, 2), rec("decode", 10, 14, pieces=(11, 12)),
             rec("embed", 14, 14.5, key=(0,)), rec("embed", 14.5, 15, key=(1,)), rec("agg", 15, 15.1)]
    cp = critical_path(g, nodes)
    # decode runs 2..6 in the bound; piece 1 at 4 -> embed 4..4.5; agg waits for the decode (6) -> 6.1
    assert cp.seconds == pytest.approx(6.1)
    assert [s.node for s in cp.path] == ["prefill", "decode", "agg"]
    # Had the embed of piece 1 been long, it would set the bound from its piece's time, not the decode's end.
    nodes[3] = rec("embed", 14.5, 18.5, key=(1,))
    cp = critical_path(g, nodes)
    assert cp.seconds == pytest.approx(2 + 2 + 4 + 0.1)
    assert [(s.node, s.key) for s in cp.path] == [("prefill", ()), ("decode", ()), ("embed", (1,)), ("agg", ())]


def test_instances_depend_only_on_their_own_scope():
    # Two region instances: each instance's second node waits for its own first node only.
    g = graph([("src", "x"), ("x", "y")], regions={"x": "src", "y": "src"})
    nodes = [rec("src", 0, 1), rec("x", 1, 2, key=(0,)), rec("x", 2, 6, key=(1,)),
             rec("y", 6, 7, key=(0,)), rec("y", 7, 8, key=(1,))]
    cp = critical_path(g, nodes)
    assert cp.seconds == pytest.approx(1 + 4 + 1)  # src, x[1], y[1]; y[0] does not wait for x[1]
    assert [(s.node, s.key) for s in cp.path] == [("src", ()), ("x", (1,)), ("y", (1,))]


def test_unstarted_and_empty_timelines():
    g = graph([("a", "b")])
    assert critical_path(g, []).seconds == 0
    cp = critical_path(g, [rec("a", 0, 1), {"node": "b", "key": [], "start": None, "end": None}])
    assert cp.seconds == pytest.approx(1)


def test_engine_bound_and_busy_union_count_overlap_once():
    tl = {"seconds": 10, "engines": [
        {"engine": "llm", "start": 0, "end": 2}, {"engine": "llm", "start": 1, "end": 3},
        {"engine": "embed", "start": 2.5, "end": 4}, {"engine": "llm", "start": 9, "end": 12}]}
    assert engine_bound(tl) == ("llm", pytest.approx(3 + 3))
    assert busy_union(tl) == pytest.approx(4 + 1)  # 0..4 and 9..10 (clipped to the run)
    o = overhead(6.0, tl)
    assert o["overhead_s"] == pytest.approx(1.0) and o["share"] == pytest.approx(1 / 6)
    assert o["client_s"] == pytest.approx(-4.0)  # a hand-built timeline longer than the call: reported as is


def test_poisson_arrivals_are_reproducible_and_at_rate():
    a = arrivals(2.0, 500, seed=1)
    assert a == arrivals(2.0, 500, seed=1) and a != arrivals(2.0, 500, seed=2)
    assert all(0 < x < 500 for x in a) and a == sorted(a)
    assert 900 < len(a) < 1100  # mean 1000
    with pytest.raises(ValueError):
        arrivals(0, 10, seed=0)


def test_percentile_interpolates():
    xs = [1.0, 2.0, 3.0, 4.0]
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 100) == 4.0 and percentile([], 50) is None


def test_batch_sizes_from_metric_snapshots():
    before = 'headrace_batch_size_bucket{engine="llm",le="1.0",op="decode"} 2.0\n' \
             'headrace_batch_size_bucket{engine="llm",le="4.0",op="decode"} 3.0\n' \
             'headrace_batch_size_bucket{engine="llm",le="+Inf",op="decode"} 3.0\n'
    after = 'headrace_batch_size_bucket{engine="llm",le="1.0",op="decode"} 3.0\n' \
            'headrace_batch_size_bucket{engine="llm",le="4.0",op="decode"} 7.0\n' \
            'headrace_batch_size_bucket{engine="llm",le="+Inf",op="decode"} 8.0\n'
    sizes = sorted(r["size"] for r in batch_sizes_between(before, after))
    assert sizes == [1, 4, 4, 4, 8]
