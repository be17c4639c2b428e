"""The run Gantt chart: row order, lane stacking, and valid PNGs for ordinary and edge-case runs."""

import io

import pytest
from PIL import Image

from headrace.daemon.timeline_plot import EXECUTOR, assign_lanes, figure_png, op_colour, timeline_png, timeline_rows


def node(name, op, engine, start, end, key=(), pieces=(), state="done"):
    return {"node": name, "op": op, "engine": engine, "key": list(key), "state": state,
            "start": start, "end": end, "pieces": list(pieces)}


def run(nodes, engines=(), seconds=3.0, status="succeeded"):
    return {"run": "ab12cd34ef56ab78", "workflow": "advanced_rag", "status": status, "seconds": seconds,
            "nodes": list(nodes), "engines": list(engines)}


RAG = run([
    node("chunk", "chunk", None, 0.0, 0.01),
    node("embed_chunks", "embed", "minilm", 0.02, 0.4),
    node("expand_decode", "partial_decode", "smollm2", 0.01, 2.4, pieces=[0.9, 1.6, 2.3]),
    node("embed_queries", "embed", "minilm", 0.95, 0.99, key=[0]),
    node("embed_queries", "embed", "minilm", 0.96, 1.0, key=[1]),  # overlaps key 0: a second lane
    node("search", "search", "lancedb", 1.1, 1.2),
    node("merge", "function", None, 2.5, 2.51),
    node("answer", "decode", "smollm2", 2.6, None, state="running"),
    node("unreached", "rerank", "reranker", None, None, state="skipped"),
], engines=[{"engine": "smollm2", "op": "decode", "size": 1, "start": 0.02, "end": 0.05},
            {"engine": "minilm", "op": "embed", "size": 16, "start": 0.02, "end": 0.4},
            {"engine": "elsewhere", "op": "decode", "size": 3, "start": 0.0, "end": 1.0}])


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:4] == b"\x89PNG"
    return Image.open(io.BytesIO(data)).size


def test_rows_follow_first_start_and_engineless_nodes_share_the_executor_row():
    # Never-started nodes get no row; engines seen only in busy records get none either.
    assert timeline_rows(RAG) == [EXECUTOR, "smollm2", "minilm", "lancedb"]


def test_rows_of_an_empty_run():
    assert timeline_rows(run([])) == []
    assert timeline_rows({"nodes": None}) == []


def test_overlapping_intervals_stack_and_disjoint_ones_share_a_lane():
    assert assign_lanes([(0, 2), (1, 3), (2, 4), (3, 5), (3.5, 6)]) == [0, 1, 0, 1, 2]
    assert assign_lanes([(1, 2), (0, 5), (0, 1)]) == [0, 1, 0]  # by start, whatever the input order
    assert assign_lanes([]) == []


def test_op_colours_are_stable_and_cover_unknown_ops():
    assert op_colour("decode") == op_colour("decode") != op_colour("embed")
    assert op_colour("made_up_op") == op_colour("made_up_op")


def test_gantt_is_a_png_that_grows_with_lanes():
    width, height = png_size(timeline_png(RAG))
    assert 1000 <= width <= 1400 and height > 200
    crowded = run([node("d", "decode", "smollm2", 0.0, 1.0, key=[i]) for i in range(12)])
    assert png_size(timeline_png(crowded))[1] > png_size(timeline_png(run(crowded["nodes"][:1])))[1]


def test_many_lanes_stay_within_a_bounded_height():
    wide = run([node("e", "embed", "minilm", 0.0, 1.0, key=[i]) for i in range(200)])
    assert png_size(timeline_png(wide))[1] < 5000


@pytest.mark.parametrize("timeline", [
    run([]),  # zero nodes: "no primitives ran"
    run([node("x", "decode", "smollm2", None, None)]),  # nothing started
    run([node("only", "chunk", None, 0.0, 0.0)], seconds=0.0),  # zero-length run
    run([node("bad", "made_up_op", None, 0.1, 0.2, state="failed")], seconds=None),
    {"nodes": [node("late", "decode", "smollm2", 0.5, None)]},  # no run metadata, still running
])
def test_edge_cases_still_render(timeline):
    width, height = png_size(timeline_png(timeline))
    assert width > 0 and height > 0


def test_title_and_figure_png():
    from matplotlib.figure import Figure

    assert png_size(timeline_png(RAG, title="custom title"))[0] > 0
    fig = Figure(figsize=(2, 1), dpi=50)
    assert png_size(figure_png(fig)) == (100, 50)


def test_every_state_a_bar_shows_is_in_the_legend():
    # A cancelled bar once took a style the legend lacked: each styled bar's edge and hatch must be a legend entry.
    from matplotlib.colors import to_rgba

    from headrace.daemon.timeline_plot import timeline_figure

    timeline = run([node("ok", "embed", "minilm", 0.0, 0.5),
                    node("gone", "decode", "smollm2", 0.1, 0.7, state="cancelled"),
                    node("bad", "rerank", "reranker", 0.2, 0.3, state="failed"),
                    node("late", "prefill", "smollm2", 0.4, None)], status="cancelled")
    fig = timeline_figure(timeline)
    legend = [(h.get_label(), to_rgba(h.get_edgecolor()), h.get_hatch()) for h in fig.legends[0].legend_handles
              if h.get_hatch()]
    assert [label for label, *_ in legend] == ["still running", "failed", "cancelled"]
    bars = [(to_rgba(p.get_edgecolor()), p.get_hatch()) for p in fig.axes[0].patches if p.get_hatch()]
    assert len(bars) == 3
    assert {bar for bar in bars} == {(edge, hatch) for _, edge, hatch in legend}
