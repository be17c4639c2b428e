"""The quality benchmark's report: ``results.json`` and one markdown table, speed beside quality, CPU named."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

PATH_NAMES = {"cold": "cold prefill", "prefix-hit": "prefix-cache hit", "fork": "fork",
              "host": "KV tier: host memory", "disk": "KV tier: disk (restarted)",
              "pieces": "other pieces (numeric floor)"}


def describe_cpu() -> dict[str, Any]:
    """The CPU's model and the flags that decide the kernels (AVX2, AVX-512, AMX), the llama.cpp CPU variant this
    process loaded, and the dtype torch's ``auto`` picks here."""
    name, flags = "unknown CPU", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "unknown CPU":
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value.split()
    except OSError:
        pass
    wanted = sorted(f for f in flags if f == "avx2" or f.startswith(("avx512", "amx")))
    out: dict[str, Any] = {"model": name, "cores": len(os.sched_getaffinity(0)), "flags": wanted}
    try:
        from headrace.plugins.engines.llama_cpp.cpu import loaded_variant, variant_name

        loaded = loaded_variant()
        out["llama_cpp_variant"] = variant_name(loaded) if loaded is not None else None
    except Exception:  # llama-cpp-python missing: no variant to name
        out["llama_cpp_variant"] = None
    try:
        from headrace.plugins.engines.models.loading import cpu_has_bf16_kernels

        out["torch_auto_dtype"] = "bfloat16" if cpu_has_bf16_kernels() else "float32"
    except Exception:
        out["torch_auto_dtype"] = None
    return out


def cpu_line(cpu: dict[str, Any]) -> str:
    flags = cpu.get("flags") or []
    avx512 = sorted(f.removeprefix("avx512").removeprefix("_") or "f" for f in flags if f.startswith("avx512"))
    amx = [f for f in flags if f.startswith("amx")]
    parts = [f"{cpu.get('model')}, {cpu.get('cores')} cores",
             "avx2" if "avx2" in flags else "no avx2",
             f"avx512 {'/'.join(avx512)}" if avx512 else "no avx512",
             " ".join(amx) if amx else "no amx"]
    tail = []
    if cpu.get("llama_cpp_variant"):
        tail.append(f"llama.cpp CPU variant `{cpu['llama_cpp_variant']}`")
    if cpu.get("torch_auto_dtype"):
        tail.append(f"torch `auto` = {cpu['torch_auto_dtype']}")
    return "; ".join(parts) + (f" ({', '.join(tail)})" if tail else "")


def _num(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt)


def _kl(value: Any) -> str:
    """Four decimals, or two significant digits below 0.001 (a float32 engine's KL is ~1e-7: not 0.0000)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return "0" if value == 0 else format(value, ".4f") if value >= 1e-3 else format(value, ".1e")


def table(results: dict[str, Any]) -> str:
    lines = ["| engine | weights / dtype | KV path | mean KL | p99 KL | top-1 | identical answers (first token) | prefill tok/s "
             "(long prompts) | decode tok/s (1 stream) | holds the bar |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        variant = r["variant"] + (" (as installed)" if r["engine"] == "llama-cpp" and r["variant"] == "none" else "")
        dtype = results.get("engines", {}).get(f"{r['engine']} {r['variant']}", {}).get("dtype")
        if r["engine"] == "torch" and r["variant"] == "auto" and dtype:
            variant = f"auto ({dtype})"
        if r["default"]:
            variant = f"**{variant}** (config)"
        path = PATH_NAMES.get(r["path"], r["path"])
        if r["taken"] < r["of"]:
            path += f" (taken {r['taken']}/{r['of']})"
        identical = "-" if r["identical"] is None else f"{r['identical']:.0%}"
        if r.get("first_token") is not None:
            identical += f" ({r['first_token']:.0%})"
        lines.append(f"| {r['engine']} | {variant} | {path} | {_kl(r['mean_kl'])} | {_kl(r['p99_kl'])}"
                     f" | {_num(r['top1'], '.1%')} | {identical} | {_num(r['prefill_tok_s'], ',.0f')} | "
                     f"{_num(r['decode_tok_s'], '.1f')} | {'yes' if r['holds_bar'] else 'no'} |")
    return "\n".join(lines)


def text_report(results: dict[str, Any]) -> str:
    meta, ref, ps = results.get("meta", {}), results["reference"], results["prompt_set"]
    when = meta.get("time", time.strftime("%Y-%m-%dT%H:%M:%S")).replace("T", " ")
    cores = meta.get("cpu_cores", {})
    head = [f"# headrace bench quality, {when}", "",
            f"CPU: {cpu_line(meta.get('cpu', describe_cpu()))}; other processes used "
            f"{cores.get('other_processes', float('nan')):.2f} cores on average meanwhile.",
            f"Command: `{meta.get('command', 'headrace bench quality')}`", "",
            f"Reference: {ref['implementation']} on `{Path(ref['model']).name}` as installed (answers "
            f"{'from the cache' if ref.get('answers_cached') else 'computed in this run'}; rows "
            f"{ref.get('rows_s', 0):.0f} s). {ps['prompts']} prompts (set `{ps['digest']}`: "
            + ", ".join(f"{k} {v}" for k, v in ps["kinds"].items())
            + (f"; the {ps['name']} set" if ps.get("name", "main") != "main" else "")
            + f"; {ps['prompt_tokens']:,} prompt tokens, the longest {ps['longest']}), {ps['answer_tokens']}-token "
            "greedy answers, scored teacher-forced. Bar for a default: top-1 >= 97% and mean KL <= 0.02 nats.", ""]
    configs = results.get("configs", [])
    if len(results.get("done", configs)) < len(configs):
        head += [f"Partial: {len(results['done'])} of {len(configs)} configurations measured so far "
                 f"({', '.join(results['done']) or 'none'}).", ""]
    if meta.get("omp_wait_policy"):
        head += [f"OpenMP waiters: `OMP_WAIT_POLICY={meta['omp_wait_policy']}` (the run's environment).", ""]
    notes = [f"- {c['label']}: {c['note']}" for c in configs if c.get("note")]
    skipped = [f"- {r['engine']} {r['variant']} {r['path']}: {r['of'] - r['taken']} prompts served by another path, "
               f"e.g. {r['not_taken'][0]}" for r in results["rows"] if r["taken"] < r["of"] and r["not_taken"]]
    return "\n".join(head + [table(results)] + ([""] + notes if notes else []) + ([""] + skipped if skipped else []))


def write(results: dict[str, Any], out: Path) -> tuple[list[Path], str]:
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "results.json", out / "results.md"]
    files[0].write_text(json.dumps(results, indent=1, default=str))
    text = text_report(results)
    files[1].write_text(text + "\n")
    return files, text


__all__ = ["describe_cpu", "cpu_line", "table", "text_report", "write"]
