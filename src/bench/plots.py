"""Benchmark figures as PNG files: latency and goodput against load, batch sizes, speedups, a run's Gantt.

Built on ``matplotlib.figure.Figure`` with an Agg canvas (via ``daemon.timeline_plot.figure_png``), never pyplot,
so one benchmark process can draw many figures without state leaking between them.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from headrace.daemon.timeline_plot import figure_png, timeline_png

DPI = 100
MAX_PANELS = 8  # batch-size histograms; more than this is unreadable at one figure's size
CYCLE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
         "#bcbd22", "#17becf")


def save(fig: Figure, path: str | os.PathLike) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(figure_png(fig))


def _no_data(ax, text: str = "no data") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#636363")


def _value(point: dict, key: str) -> float:
    v = point.get(key)
    return math.nan if v is None else float(v)  # NaN leaves a gap in the line instead of failing


def latency_vs_load(series: dict[str, list[dict]], path, title: str, slo_s: float | None = None) -> None:
    """Left: p50 (solid) and p95 (dashed) latency per mode against offered rate; right: goodput."""
    fig = Figure(figsize=(12, 4.8), dpi=DPI, layout="constrained")
    lat, good = fig.subplots(1, 2)
    fig.suptitle(title)
    latencies, rates = [], []
    for i, (mode, points) in enumerate(series.items()):
        points = sorted((p for p in points if p.get("rate") is not None), key=lambda p: p["rate"])
        x = [p["rate"] for p in points]
        colour = CYCLE[i % len(CYCLE)]
        p50, p95 = [_value(p, "p50_s") for p in points], [_value(p, "p95_s") for p in points]
        lat.plot(x, p50, color=colour, marker="o", markersize=4, label=mode)
        lat.plot(x, p95, color=colour, marker="o", markersize=3, linestyle="--")
        good.plot(x, [_value(p, "goodput") for p in points], color=colour, marker="o", markersize=4, label=mode)
        latencies += [v for v in p50 + p95 if v > 0]
        rates += x
    if not rates:
        _no_data(lat)
        _no_data(good)
    # Past saturation latency grows by orders of magnitude; a log axis keeps the knee readable.
    if latencies and max(latencies) / min(latencies) > 30:
        lat.set_yscale("log")
    handles = [Line2D([], [], color="black", label="p50"), Line2D([], [], color="black", linestyle="--", label="p95")]
    if slo_s is not None:
        lat.axhline(slo_s, color="#d62728", linestyle=":", linewidth=1.2)
        handles.append(Line2D([], [], color="#d62728", linestyle=":", label=f"SLO {slo_s:g} s"))
    lat.set(xlabel="offered load (requests/s)", ylabel="latency (s)", title="latency vs load")
    if rates:
        top = max(rates) * 1.05
        good.plot([0, top], [0, top], color="#bdbdbd", linestyle=":", linewidth=1, zorder=0)  # goodput = offered
        handles_modes, _ = lat.get_legend_handles_labels()
        lat.legend(handles=handles_modes + handles, fontsize=8)
    good.set(xlabel="offered load (requests/s)", ylabel="goodput (requests/s)", title="goodput vs load")
    good.set_xlim(left=0)
    good.set_ylim(bottom=0)
    for ax in (lat, good):
        ax.grid(color="#e0e0e0", linewidth=0.6)
    save(fig, path)


def timeline(timeline: dict, path, title: str | None = None) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(timeline_png(timeline, title))


def batch_groups(activity: list[dict]) -> dict[tuple[str, str], list[int]]:
    """Batch sizes per (engine, op), most batches first; at most ``MAX_PANELS`` groups."""
    groups: dict[tuple[str, str], list[int]] = {}
    for record in activity:
        if record.get("size") is not None:
            groups.setdefault((str(record.get("engine")), str(record.get("op"))), []).append(int(record["size"]))
    ranked = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    return dict(ranked[:MAX_PANELS])


def batch_sizes(activity: list[dict], path, title: str) -> None:
    """A histogram of batch sizes per (engine, op): how many batches ran at each size."""
    groups = batch_groups(activity)
    total_groups = len({(r.get("engine"), r.get("op")) for r in activity if r.get("size") is not None})
    cols = min(4, max(1, len(groups)))
    rows = max(1, math.ceil(len(groups) / cols))
    fig = Figure(figsize=(min(12, 3.4 * cols + 0.6), 2.8 * rows + 0.5), dpi=DPI, layout="constrained")
    more = f"  (the {len(groups)} busiest of {total_groups} engine/op pairs)" if total_groups > len(groups) else ""
    fig.suptitle(title + more)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    if not groups:
        _no_data(axes[0], "no batches")
    for ax, ((engine, op), sizes) in zip(axes, groups.items()):
        counts = Counter(sizes)
        xs = sorted(counts)
        if xs[-1] <= 64:  # one bar per size: sizes are small integers
            ax.bar(xs, [counts[x] for x in xs], width=0.85, color="#4c72b0")
        else:
            ax.hist(sizes, bins=30, color="#4c72b0")
        mean = sum(sizes) / len(sizes)
        per_request = sum(s * s for s in sizes) / sum(sizes) if sum(sizes) else 0.0  # the batch a request rode in
        ax.axvline(mean, color="#d62728", linestyle="--", linewidth=1)
        # The numbers go in the title: inside the axes they would cover bars.
        ax.set_title(f"{engine} · {op}\n{len(sizes)} batches · mean {mean:.1f} · per request {per_request:.1f}",
                     fontsize=8)
        ax.set_xlim(0, xs[-1] + 1)  # from 0, so a lone size still reads as small or large
        ax.set_xlabel("batch size", fontsize=8)
        ax.set_ylabel("batches", fontsize=8)
        ax.tick_params(labelsize=8)
        for axis in (ax.xaxis, ax.yaxis):
            axis.get_major_locator().set_params(integer=True)
    for ax in axes[max(1, len(groups)):]:
        ax.set_visible(False)
    save(fig, path)


def ratios_bar(table: dict[str, float], path, title: str) -> None:
    """Speedup per mode against the baseline, top to bottom in the table's order; 1.0 is the baseline."""
    items = [(mode, float(r)) for mode, r in table.items() if r is not None and math.isfinite(r)]
    fig = Figure(figsize=(8, max(2.0, 0.4 * len(items) + 1.2)), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    ax.set_title(title)
    if not items:
        _no_data(ax)
        ax.set_yticks([])
    else:
        labels, ratios = zip(*items)
        ys = range(len(items))
        colours = ["#2ca02c" if r >= 1 else "#d62728" for r in ratios]
        ax.barh(ys, ratios, color=colours, height=0.6)
        ax.set_yticks(ys, labels)
        ax.invert_yaxis()
        top = max(max(ratios), 1.0) * 1.15
        ax.set_xlim(0, top)
        for y, r in zip(ys, ratios):
            ax.text(r + top * 0.01, y, f"{r:.2f}×", va="center", fontsize=8, zorder=3,
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xlabel("speedup vs baseline (×)")
    ax.grid(axis="x", color="#e0e0e0", linewidth=0.6)
    ax.set_axisbelow(True)
    save(fig, path)
