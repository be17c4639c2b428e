"""The harness's results as files: JSON, a text table per workload, and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from headrace.bench.workloads import HEADRACE, SEQUENTIAL, is_headrace


def _f(x: Any, spec: str = ".2f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def single_table(name: str, section: dict[str, Any]) -> list[str]:
    single = section["single"]
    baseline = next((m for m in section["modes"] if m in ("llamaindex", "chaining", "client")), None)
    warmup = "after warm-up" if single.get("warmup", True) else "without warm-up (cold first run)"
    lines = [f"== {name}: single query, mean of {next(iter(single['modes'].values()))['reps']} reps {warmup} "
             f"(config {json.dumps(section['config'])}) =="]
    head = f"{'mode':<24} {'mean s':>7} {'median s':>8}"
    if baseline:
        head += f" {'vs ' + baseline:>14}"
    head += f" {'vs sequential':>13} {'overhead':>8}"
    lines.append(head)
    for mode, row in single["modes"].items():
        line = f"{mode:<24} {row['mean_s']:7.2f} {row['median_s']:8.2f}"
        if baseline:
            line += f" {_f(row.get(f'speedup_vs_{baseline}'), '.2f') + 'x' if mode != baseline else '1.00x':>14}"
        line += f" {_f(row.get('speedup_vs_sequential'), '.2f') + 'x' if mode != SEQUENTIAL else '1.00x':>13}"
        line += f" {_f(row.get('overhead_share'), '.1%'):>8}"
        lines.append(line)
    if "latency_over_bound" in single:
        lines.append(f"critical-path bound {single['bound_s']:.2f}s (isolated primitives, longest path); "
                     f"headrace latency / bound = {single['latency_over_bound']:.2f}x")
        lines.append(f"with the busiest engine's total compute as a floor too: bound {single['tight_bound_s']:.2f}s, "
                     f"latency / bound = {single['latency_over_tight_bound']:.2f}x")
        path = single["critical_path"][0]["path"]
        lines.append("  path (rep 0): " + " -> ".join(f"{s['node']}{'[' + ','.join(map(str, s['key'])) + ']' if s['key'] else ''}"
                                                       f" {s['seconds']:.2f}s" for s in path))
    row = single["modes"].get(HEADRACE, {})
    if "overhead" in row:
        o = row["overhead"]
        lines.append(f"headrace overhead: {o['overhead_s']:.3f}s of {o['e2e_s']:.2f}s ({row['overhead_share']:.1%}): "
                     f"client+HTTP+build {o['client_s']:.3f}s, in-executor outside compute {o['executor_s']:.3f}s")
    return lines


def load_table(name: str, load: dict[str, Any]) -> list[str]:
    capacity = f", capacity {load['capacity']:.3f} req/s" if load.get("capacity") else ""
    lines = [f"== {name}: Poisson load, SLO {load['slo_s']:.1f}s{capacity} ==",
             f"{'mode':<20} {'rate':>6} {'offered':>7} {'done':>5} {'mean s':>7} {'p50 s':>7} {'p95 s':>7} "
             f"{'p99 s':>7} {'thruput':>8} {'goodput':>8}"]
    for mode, points in load["series"].items():
        for p in points:
            lines.append(f"{mode:<20} {p['rate']:6.3f} {p['offered']:7d} {p['completed']:5d} {_f(p['mean_s']):>7} "
                         f"{_f(p['p50_s']):>7} {_f(p['p95_s']):>7} {_f(p['p99_s']):>7} {p['throughput']:8.3f} "
                         f"{p['goodput']:8.3f}")
    for (mode, base), per_rate in goodput_ratios(load).items():
        lines.append(f"{mode} / {base}: " + ", ".join(
            f"{r:g} req/s goodput {_f(v['goodput'], '.2f')}x, p95 {_f(v['p95'], '.2f')}x" for r, v in per_rate.items()))
    return lines


def goodput_ratios(load: dict[str, Any]) -> dict[tuple[str, str], dict[float, dict[str, float | None]]]:
    """Each headrace mode against each other mode, per rate: goodput ratio and p95 ratio (headrace's / the other's)."""
    series = load["series"]
    out = {}
    for mode, points in series.items():
        if not is_headrace(mode):
            continue
        for base, base_points in series.items():
            if base == mode or (is_headrace(base) and list(series).index(base) > list(series).index(mode)):
                continue
            out[(mode, base)] = {
                h["rate"]: {"goodput": h["goodput"] / b["goodput"] if b["goodput"] else None,
                            "p95": h["p95_s"] / b["p95_s"] if h["p95_s"] and b["p95_s"] else None}
                for h, b in zip(points, base_points)}
    return out


def mixed_table(mixed: dict[str, Any]) -> list[str]:
    lines = [f"== mixed load: {' + '.join(mixed['workloads'])} co-located at {mixed['rate']:g} req/s in all =="]
    for mode, per in mixed["modes"].items():
        parts = [f"{w}: p50 {_f(per[w]['p50_s'])}s p95 {_f(per[w]['p95_s'])}s goodput {per[w]['goodput']:.3f}/s "
                 f"({per[w]['completed']}/{per[w]['offered']})" for w in mixed["workloads"]]
        lines.append(f"{mode:<12} " + "; ".join(parts))
    modes = mixed["modes"]
    for mode in (m for m in modes if is_headrace(m)):
        if "baselines" in modes and modes["baselines"]["all"]["goodput"]:
            lines.append(f"{mode} / baselines total goodput: "
                         f"{modes[mode]['all']['goodput'] / modes['baselines']['all']['goodput']:.2f}x")
    return lines


def chat_table(chat: dict[str, Any]) -> list[str]:
    lines = [f"== chat: {chat['requests']} chats one at a time on a shared {chat['system_tokens']}-token system "
             f"prompt, time to first token =="]
    for mode, row in chat["modes"].items():
        lines.append(f"{mode:<20} mean {row['mean_s'] * 1000:7.0f} ms  p50 {_f(row['p50_s'] * 1000, '.0f')} ms  "
                     f"p95 {_f(row['p95_s'] * 1000, '.0f')} ms")
    lines.append(f"prefix caching speeds time to first token up {_f(chat.get('ttft_speedup'), '.2f')}x")
    return lines


def text_report(results: dict[str, Any]) -> str:
    lines: list[str] = []
    if "soak" in results:
        from headrace.bench.soak_report import soak_table

        lines += soak_table(results["soak"]) + [""]
    for name, section in results.get("workloads", {}).items():
        if "collection" in section:
            c = section["collection"]
            lines.append(f"== {name}: the corpus indexed once as collection {c['name']!r} ({c['documents']} documents, "
                         f"{c['chunks']} chunks): " + ", ".join(f"{system} {seconds:.2f}s"
                                                                for system, seconds in c["index_s"].items()))
        if "single" in section:
            lines += single_table(name, section) + [""]
        if "load" in section:
            lines += load_table(name, section["load"]) + [""]
    if "chat" in results:
        lines += chat_table(results["chat"]) + [""]
    if "mixed" in results:
        lines += mixed_table(results["mixed"]) + [""]
    if "agents" in results:
        from headrace.bench.agents_phase import agents_table

        lines += agents_table(results["agents"]) + [""]
    if "mixed_programs" in results:
        from headrace.bench.mixed_phase import mixed_programs_table

        lines += mixed_programs_table(results["mixed_programs"]) + [""]
    meta = results.get("meta", {})
    if meta:
        lines.append(f"machine: {meta.get('machine')}; other processes used {meta.get('cpu_other', 0):.2f} cores "
                     f"meanwhile; {meta.get('elapsed_s', 0):.0f}s in all")
    return "\n".join(lines)


def write(results: dict[str, Any], out: Path) -> list[Path]:
    """results.json, results.txt and the plots under ``out``; returns the files written."""
    from headrace.bench import plots  # matplotlib only once there is something to draw

    out.mkdir(parents=True, exist_ok=True)
    files = [out / "results.json", out / "results.txt"]
    files[0].write_text(json.dumps(results, indent=2, default=str))
    files[1].write_text(text_report(results) + "\n")
    for name, section in results.get("workloads", {}).items():
        single = section.get("single")
        if single:
            baseline = next((m for m in section["modes"] if m in ("llamaindex", "chaining", "client")), SEQUENTIAL)
            key = f"speedup_vs_{baseline}"
            ratios = {m: row[key] for m, row in single["modes"].items() if key in row}
            if ratios:
                files.append(out / f"{name}-speedup.png")
                plots.ratios_bar(ratios, files[-1], f"{name}: single-query speedup vs {baseline}")
        if single and single.get("timeline"):
            files.append(out / f"{name}-timeline.png")
            plots.timeline(single["timeline"], files[-1], f"{name}: one headrace run (rep 0)")
        load = section.get("load")
        if load:
            files.append(out / f"{name}-latency-vs-load.png")
            plots.latency_vs_load(load["series"], files[-1], f"{name}: latency and goodput vs offered load",
                                  slo_s=load["slo_s"])
            for mode, records in load["batch_sizes"].items():
                files.append(out / f"{name}-batch-sizes-{mode}.png")
                plots.batch_sizes(records, files[-1], f"{name} under load, {mode}: batch sizes per engine")
    return files
