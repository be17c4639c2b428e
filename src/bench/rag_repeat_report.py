"""``rag-repeat``'s result files: results.json, and results.txt with a table per workflow and load point.

Columns (docs/benchmarks.md says the same):

- ``done``: completed queries / arrivals at the point;
- ``mean s``, ``p95 s``: a query's latency, request sent to answer read (a peer query: its first request
  to its last answer);
- ``TTFT s``: time to the final answer's first token from the request's start (headrace: the run's first
  ``node.partial`` event with a ``delta``, which only the decode writing the answer streams; the peer: the
  final call's first streamed token);
- ``prompt/q``, ``prefill/q``: the LLM's prompt tokens a completed query, and of those the tokens prefilled
  (not served by a cache): headrace's from its /metrics before and after the point, the peer's from
  llama-server's ``timings.prompt_n`` per call;
- ``host``, ``disk``: prompts a KV tier restored (their tokens in results.json);
- ``same``: answers identical to ``engine-cache``'s for the same queries (greedy), among those both
  completed;
- ``x lat``, ``x pre``: ``engine-cache``'s mean latency and prefilled tokens over the mode's (above 1: the mode
  is better); ``x peer``: ``llama-server``'s mean latency over the mode's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ENGINE_CACHE, PEER = "engine-cache", "llama-server"


def _f(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def same_answers(mine: list[str | None], theirs: list[str | None]) -> dict[str, Any]:
    """The share of queries answered identically, among those both completed."""
    pairs = [(a, b) for a, b in zip(mine, theirs) if a is not None and b is not None]
    same = sum(a == b for a, b in pairs)
    return {"same": same, "compared": len(pairs), "share": same / len(pairs) if pairs else None}


def compare(results: dict[str, Any]) -> None:
    """Each mode's point against engine-cache's and llama-server's, in place (``vs`` per point)."""
    for modes in results["workflows"].values():
        base, peer = modes.get(ENGINE_CACHE, {}), modes.get(PEER, {})
        for row in modes.values():
            for k, point in enumerate(row.get("points", [])):
                b = base["points"][k] if "points" in base else None
                p = peer["points"][k] if "points" in peer else None
                point["vs"] = {
                    "latency_vs_engine_cache": _ratio(b and b["mean_s"], point["mean_s"]),
                    "prefilled_vs_engine_cache": _ratio(b and b["prefilled_per_query"], point["prefilled_per_query"]),
                    "latency_vs_llama_server": _ratio(p and p["mean_s"], point["mean_s"]),
                    "same_as_engine_cache": same_answers(point["answers"], b["answers"]) if b else None}


def point_label(results: dict[str, Any], workflow: str, k: int) -> str:
    rate = results["rates"][workflow][k]
    fractions = results["options"]["fractions"]
    return f"{fractions[k]:g} x capacity ({rate:g} q/s)" if k < len(fractions) else f"{rate:g} q/s"


def tables(results: dict[str, Any]) -> list[str]:
    c, r = results["collection"], results.get("retrieval") or {}
    o = results["options"]
    lines = [f"== rag-repeat: a collection of {c['chunks']} chunks ({c['chunk_size']} words, {c['chunk_overlap']} "
             f"shared) from {c['documents']} documents; questions on {c['topics']} topics, Zipf s={o['zipf']:g}; "
             f"max_tokens {o['max_tokens']}, greedy =="]
    if r:
        lines.append(f"the top 3% of chunks ({r['top_chunks']} of {r['chunks']}) drew {r['top_share']:.0%} of the "
                     f"question searches' retrievals (top {r['top_k']}, {r['queries']} queries; {r['chunks_retrieved']} "
                     "chunks retrieved at all)")
    for mode, why in results.get("skipped", {}).items():
        lines.append(f"{mode}: skipped: {why}")
    head = (f"{'mode':<20} {'done':>7} {'mean s':>7} {'p95 s':>7} {'TTFT s':>7} {'prompt/q':>8} {'prefill/q':>9} "
            f"{'host':>5} {'disk':>5} {'same':>6} {'x lat':>6} {'x pre':>6} {'x peer':>6}")
    for workflow, modes in results["workflows"].items():
        cap = results["capacity"].get(workflow)
        if cap:
            lines.append(f"{workflow}: capacity {cap['queries_per_s']:.4f} queries/s (1 / {cap['mean_s']:.2f}s, the "
                         f"mean of {len(cap['probe_s'])} warm queries one at a time in {cap['mode']})")
        for k in range(len(results["rates"].get(workflow, []))):
            lines += ["", f"== {workflow} at {point_label(results, workflow, k)}, {o['arrivals']} arrivals a mode ==",
                      head]
            for mode, row in modes.items():
                if "points" not in row:
                    continue
                p = row["points"][k]
                t, vs = p["tokens"], p.get("vs", {})
                tiers = t.get("tiers", {})
                same = (vs.get("same_as_engine_cache") or {}).get("share")
                lines.append(
                    f"{mode:<20} {p['completed']:>3}/{p['arrivals']:<3} {_f(p['mean_s']):>7} {_f(p['p95_s']):>7} "
                    f"{_f(p['ttft_mean_s']):>7} {p['prompt_per_query']:8.0f} {p['prefilled_per_query']:9.0f} "
                    f"{_f(tiers.get('host', {}).get('hits'), '.0f'):>5} {_f(tiers.get('disk', {}).get('hits'), '.0f'):>5} "
                    f"{_f(same, '.0%'):>6} {_f(vs.get('latency_vs_engine_cache')):>6} "
                    f"{_f(vs.get('prefilled_vs_engine_cache')):>6} {_f(vs.get('latency_vs_llama_server')):>6}")
                for error in p["errors"]:
                    lines.append(f"  {mode}: {error}")
            sources = {row["points"][k]["tokens"]["cached_source"] for row in modes.values() if "points" in row}
            lines.append(f"cached tokens from: {', '.join(sorted(sources))}")
            for mode, row in modes.items():
                kv = (row.get("indexing") or {}).get("chunk_kv")
                if kv and "prompts" in kv:
                    lines.append(f"{mode}: chunks prefilled at ingest: {kv['prompts']} prompts, {kv['tokens']:,} "
                                 f"tokens in {kv['seconds']:.1f}s (indexing {row['indexing']['seconds']:.1f}s in all)")
                elif kv:
                    lines.append(f"{mode}: chunks not prefilled at ingest: {kv.get('skipped') or kv.get('error')}")
            for mode, row in modes.items():
                if "failed" in row or ("skipped" in row and mode not in results.get("skipped", {})):
                    lines.append(f"{mode}: {'failed' if 'failed' in row else 'skipped'}: "
                                 f"{(row.get('failed') or row['skipped']).splitlines()[0][:300]}")
    lines += restart_table(results.get("restart"))
    return lines


def restart_table(restart: dict[str, Any] | None) -> list[str]:
    if not restart:
        return []
    if "failed" in restart:
        return ["", f"== restart: failed: {restart['failed'].splitlines()[0][:300]} =="]
    lines = ["", f"== restart: {restart['workflow']} in {restart['mode']}: {restart['warm_queries']} queries warm, "
                 f"then {restart['timed_queries']} timed one at a time ==",
             f"{'start':<28} {'mean s':>7} {'p95 s':>7} {'TTFT s':>7} {'prefill/q':>9} {'disk':>5} {'/ warm':>7}"]
    warm = restart["warm"]["mean_s"]
    names = {"restarted": "restarted on the same data", "warm": "warm, not restarted", "empty": "empty (fresh data)"}
    for case in ("restarted", "warm", "empty"):
        s = restart[case]
        disk = s["tokens"].get("tiers", {}).get("disk", {}).get("hits")
        lines.append(f"{names[case]:<28} {_f(s['mean_s']):>7} {_f(s['p95_s']):>7} {_f(s['ttft_mean_s']):>7} "
                     f"{s['prefilled_per_query']:9.0f} {_f(disk, '.0f'):>5} {_f(_ratio(s['mean_s'], warm)):>7}")
    restart["ratios"] = {"restarted_over_warm": _ratio(restart["restarted"]["mean_s"], warm),
                         "empty_over_restarted": _ratio(restart["empty"]["mean_s"], restart["restarted"]["mean_s"]),
                         "ttft_restarted_over_warm": _ratio(restart["restarted"]["ttft_mean_s"],
                                                            restart["warm"]["ttft_mean_s"])}
    lines.append(f"restarted / warm: {_f(restart['ratios']['restarted_over_warm'])}x latency, "
                 f"{_f(restart['ratios']['ttft_restarted_over_warm'])}x TTFT (target <= 1.2); empty / restarted: "
                 f"{_f(restart['ratios']['empty_over_restarted'])}x")
    return lines


def text_report(results: dict[str, Any]) -> str:
    compare(results)
    lines = tables(results)
    meta = results.get("meta", {})
    if meta:
        lines += ["", f"machine: {meta.get('machine')}; {meta.get('elapsed_s', 0):.0f}s in all"]
    return "\n".join(lines)


def write(results: dict[str, Any], out: Path) -> tuple[list[Path], str]:
    """results.json and results.txt under ``out``; the JSON written again with the ratios the text adds (first
    without them: a run's figures outlive a report that fails)."""
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "results.json", out / "results.txt"]
    files[0].write_text(json.dumps(results, indent=2, default=str))
    text = text_report(results)
    files[1].write_text(text + "\n")
    files[0].write_text(json.dumps(results, indent=2, default=str))
    return files, text


__all__ = ["write", "text_report", "same_answers", "compare"]
