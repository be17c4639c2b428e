"""PNG figures of a workflow run: a Gantt chart of its primitives per engine.

Figures are built on ``matplotlib.figure.Figure`` with an Agg canvas, never
pyplot: pyplot keeps global state that would leak between requests and threads.
Rendering takes a noticeable fraction of a second; callers on the event loop
should run it in a worker thread.
"""

from __future__ import annotations

import io
import zlib

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from headrace.graph.graph import Op

EXECUTOR = "executor"  # the row for primitives that run on no engine (chunk, function, ...)
DPI = 100
WIDTH_IN = 12.0

# One fixed colour per op, so the same op looks the same in every chart; families share a hue.
OP_COLOURS = {
    Op.PREFILL: "#6baed6", Op.PARTIAL_PREFILL: "#9ecae1", Op.FULL_PREFILL: "#3182bd",
    Op.DECODE: "#fd8d3c", Op.PARTIAL_DECODE: "#fdae6b",
    Op.EMBED: "#31a354", Op.INGEST: "#a1d99b",
    Op.SEARCH: "#756bb1", Op.TEXT_SEARCH: "#bcbddc",
    Op.RERANK: "#e377c2", Op.CHUNK: "#bdbdbd", Op.CONDITION: "#f7b6d2",
    Op.AGGREGATE: "#bcbd22", Op.FUNCTION: "#17becf",
}
SPARE_COLOURS = ("#8c564b", "#c49c94", "#dbdb8d", "#9edae5", "#c7c7c7", "#ff9896", "#98df8a", "#aec7e8")
BUSY_COLOUR = "#252525"
# How a bar shows a node that did not simply finish: its edge colour and hatch. The bars and
# the legend both read this table, so the legend always holds every style a bar uses.
STATE_STYLES = {
    "running": ("#636363", "///", "still running"),
    "failed": ("#d62728", "xx", "failed"),
    "cancelled": ("#7f7f7f", "xx", "cancelled"),
}

LANE = 1.0  # data units per lane; one bar per lane
STRIP = 0.35  # the engine-busy strip under a row
GAP = 0.55  # between rows
UNIT_IN = 0.3  # inches per data unit, until the chart gets too tall
MAX_PLOT_IN = 36.0


def op_colour(op: str) -> str:
    if op in OP_COLOURS:
        return OP_COLOURS[op]
    # crc32, not hash(): the colour of an unknown op must not change between processes.
    return SPARE_COLOURS[zlib.crc32(op.encode()) % len(SPARE_COLOURS)]


def figure_png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)  # attaches itself as fig.canvas
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=fig.dpi)
    return buf.getvalue()


def drawn_nodes(timeline: dict) -> list[dict]:
    """The node records that ran (start not null), in start order.

    A region's source is drawn to the end of its own primitive (``op_end``): its record's
    ``end`` also waits for the region, whose nodes have bars of their own.
    """
    nodes = [{**n, "end": n["op_end"]} if n.get("op_end") is not None else n
             for n in timeline.get("nodes") or () if n.get("start") is not None]
    return sorted(nodes, key=lambda n: (n["start"], n.get("end") if n.get("end") is not None else float("inf")))


def row_of(node: dict) -> str:
    return node.get("engine") or EXECUTOR


def timeline_rows(timeline: dict) -> list[str]:
    """One row per engine, in order of its first node's start; engine-less nodes share the "executor" row."""
    return list(dict.fromkeys(row_of(n) for n in drawn_nodes(timeline)))


def assign_lanes(intervals: list[tuple[float, float]]) -> list[int]:
    """Greedy interval colouring: each interval gets the first lane free at its start, so overlaps stack."""
    lane_ends: list[float] = []
    lanes = [0] * len(intervals)
    for i in sorted(range(len(intervals)), key=lambda i: intervals[i]):
        start, end = intervals[i]
        free = next((k for k, e in enumerate(lane_ends) if e <= start), None)
        if free is None:
            free = len(lane_ends)
            lane_ends.append(end)
        lane_ends[free] = end
        lanes[i] = free
    return lanes


def _label(node: dict) -> str:
    key = node.get("key") or []
    return node["node"] + (f"[{','.join(map(str, key))}]" if key else "")


def _total_seconds(timeline: dict, nodes: list[dict]) -> float:
    ends = [n["end"] for n in nodes if n.get("end") is not None] + [n["start"] for n in nodes]
    return max([timeline.get("seconds") or 0.0, *ends, 1e-3])


def _title(timeline: dict, title: str | None) -> str:
    if title:
        return title
    run, seconds = str(timeline.get("run") or "?"), timeline.get("seconds")
    total = "" if seconds is None else f"  ·  {seconds:.2f} s"
    status = timeline.get("status")
    return f"{timeline.get('workflow') or 'workflow'}  ·  run {run[:16]}{total}" + (f"  ({status})" if status else "")


def _empty_figure(title: str) -> Figure:
    fig = Figure(figsize=(WIDTH_IN, 2.0), dpi=DPI)
    fig.suptitle(title, fontsize=11)
    fig.text(0.5, 0.45, "no primitives ran", ha="center", va="center", fontsize=12, color="#636363")
    return fig


def timeline_png(timeline: dict, title: str | None = None) -> bytes:
    """A Gantt chart of one run: a row per engine, a bar per node instance, the engine's busy strip below."""
    return figure_png(timeline_figure(timeline, title))


def timeline_figure(timeline: dict, title: str | None = None) -> Figure:
    """The figure ``timeline_png`` draws."""
    nodes = drawn_nodes(timeline)
    heading = _title(timeline, title)
    if not nodes:
        return _empty_figure(heading)
    total = _total_seconds(timeline, nodes)
    rows = timeline_rows(timeline)
    busy: dict[str, list[dict]] = {r: [] for r in rows}
    for b in timeline.get("engines") or ():
        if b.get("engine") in busy and b.get("start") is not None and b.get("end") is not None:
            busy[b["engine"]].append(b)  # busy intervals of engines this run never used are left out

    # Lay rows out top-down in data units (y grows downward once the axis is inverted).
    placed: list[tuple[dict, float, float, float]] = []  # node, y of the bar's centre, start, end
    row_centres, row_spans, y = [], [], 0.0
    for r in rows:
        members = [n for n in nodes if row_of(n) == r]
        spans = [(n["start"], n["end"] if n.get("end") is not None else total) for n in members]
        lanes = assign_lanes(spans)
        depth = (max(lanes) + 1) * LANE + (STRIP if busy[r] else 0.0)
        placed += [(n, y + (k + 0.5) * LANE, s, e) for n, k, (s, e) in zip(members, lanes, spans)]
        row_spans.append((y, y + depth, max(lanes) + 1))
        row_centres.append(y + depth / 2)
        y += depth + GAP
    height_units = y - GAP

    unit_in = min(UNIT_IN, MAX_PLOT_IN / height_units)  # very many lanes: thinner lanes, not a taller PNG
    left_in = min(3.0, max(1.0, 0.08 * max(map(len, rows)) + 0.35))
    handles = _legend_handles(placed, any(busy.values()))
    ncol = min(len(handles), 8)
    legend_in, top_in, bottom_in = 0.22 * -(-len(handles) // ncol) + 0.1, 0.55, 0.55
    plot_in = max(1.2, height_units * unit_in)
    fig_h = plot_in + top_in + bottom_in + legend_in
    fig = Figure(figsize=(WIDTH_IN, fig_h), dpi=DPI)
    renderer = FigureCanvasAgg(fig).get_renderer()  # to measure labels
    # Fixed margins (no tight layout), so data-to-pixel transforms are final when labels are measured.
    fig.subplots_adjust(left=left_in / WIDTH_IN, right=1 - 0.25 / WIDTH_IN,
                        top=1 - top_in / fig_h, bottom=(bottom_in + legend_in) / fig_h)
    ax = fig.add_subplot()
    ax.set_xlim(0, total * 1.01)
    ax.set_ylim(height_units + GAP / 2, -GAP / 2)
    ax.set_yticks(row_centres, rows, fontsize=9)
    ax.tick_params(axis="y", length=0)
    ax.set_xlabel("seconds from run start")
    ax.set_title(heading, fontsize=11)
    ax.grid(axis="x", color="#e0e0e0", linewidth=0.6)
    ax.set_axisbelow(True)

    for i, (top, bottom, _) in enumerate(row_spans):
        if i % 2:  # banding tells adjacent rows apart when lanes are many
            ax.axhspan(top - GAP / 2, bottom + GAP / 2, color="#f5f5f5", zorder=0)
    min_width = total * 0.002  # a 1 ms embed in a 10 s run still shows
    px_per_s = ax.transData.transform((1, 0))[0] - ax.transData.transform((0, 0))[0]
    lane_px = LANE * unit_in * DPI
    label_size = 7 if lane_px >= 14 else 5

    for node, yc, start, end in placed:
        colour = op_colour(node.get("op") or "")
        style = STATE_STYLES.get(bar_state(node))
        ax.barh(yc, max(end - start, min_width), left=start, height=0.8 * LANE, color=colour,
                edgecolor=style[0] if style else _darker(colour), linewidth=0.6 if style is None else 1.2,
                hatch=style[1] if style else None,
                alpha=0.45 if node.get("state") == "skipped" else 1.0, zorder=2)
        pieces = [p for p in node.get("pieces") or () if p is not None]
        if pieces:
            ax.vlines(pieces, yc - 0.4 * LANE, yc, colors="black", linewidth=1.0, zorder=3)
        if lane_px >= 9:
            _fit_label(ax, renderer, _label(node), start, end, yc, px_per_s, label_size)

    for (top, bottom, lanes), r in zip(row_spans, rows):
        if busy[r]:
            strip_top = top + lanes * LANE + 0.05
            ax.broken_barh([(b["start"], max(b["end"] - b["start"], min_width)) for b in busy[r]],
                           (strip_top, STRIP - 0.1), facecolors=BUSY_COLOUR, zorder=2)

    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=8, frameon=False, bbox_to_anchor=(0.5, 0.0))
    return fig


def bar_state(node: dict) -> str | None:
    """Which of ``STATE_STYLES`` a node's bar takes: a bar with no end is still running."""
    return "running" if node.get("end") is None else node.get("state")


def _darker(colour: str) -> tuple[float, float, float]:
    return tuple(c * 0.6 for c in to_rgb(colour))


def _fit_label(ax, renderer, text: str, start: float, end: float, yc: float, px_per_s: float, size: float) -> None:
    """Write the label inside the bar when it fits, else not at all: overflowing labels collide."""
    bar_px = (end - start) * px_per_s
    if bar_px < 12:
        return
    label = ax.text(start + 3 / px_per_s, yc, text, va="center", ha="left", fontsize=size, zorder=4, clip_on=True)
    if label.get_window_extent(renderer).width > bar_px - 5:
        label.remove()


def _legend_handles(placed: list[tuple[dict, float, float, float]], has_busy: bool) -> list:
    ops = list(dict.fromkeys(n.get("op") or "" for n, *_ in placed))
    order = {op: i for i, op in enumerate(OP_COLOURS)}
    ops.sort(key=lambda op: (order.get(op, len(order)), op))
    handles = [Patch(facecolor=op_colour(op), edgecolor=_darker(op_colour(op)), label=op or "?") for op in ops]
    if has_busy:
        handles.append(Patch(facecolor=BUSY_COLOUR, label="engine computing"))
    if any(n.get("pieces") for n, *_ in placed):
        handles.append(Line2D([], [], color="black", marker="|", linestyle="", markersize=9, label="piece streamed"))
    states = {bar_state(n) for n, *_ in placed}
    for state, (edge, hatch, label) in STATE_STYLES.items():
        if state in states:
            handles.append(Patch(facecolor="white", edgecolor=edge, hatch=hatch, label=label))
    return handles
