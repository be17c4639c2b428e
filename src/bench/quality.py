"""``headrace bench quality``: every LLM engine and KV path against a float32 reference, speed beside quality.

The reference is Hugging Face transformers in float32 on the model file the config serves, **as installed**
(``headrace.quality.reference``), so a conversion's cost (``quantize``) shows as well as an engine's numerics. The
prompt set is fixed (``headrace.bench.quality_prompts``: chats, instructions, RAG synthesis prompts, long and
short); each prompt gets the reference's greedy answer (``--quality-tokens``, 32), cached under the cache dir by
the model file's digest and the set's hash. Then per engine configuration (an engine and a quantization or
dtype), in process, one engine at a time:

- ``cold``, ``fork``, ``pieces`` on an engine with its prefix cache off: the answer scored teacher-forced on the
  context the path filled (``headrace.quality.paths``), and the engine's own greedy answer decoded from that same
  context (a prefill then a decode: what ``generate`` does), with the prefill and one-stream decode speeds;
- ``prefix-hit`` and ``host`` on the same engine with a prefix cache that holds one prompt and the KV tiers on;
  stopping it writes the cached prefixes to the disk tier, and ``disk`` restores them on an engine started again
  on that data dir.

The default configuration (the config's own LLM engine) runs every path in ``--quality-paths``, the others
``cold`` (``--quality-paths-everywhere``: every path everywhere). Each row: mean and p99 KL(reference || engine)
over the answer tokens, top-1 agreement, the share of greedy answers identical to the reference's, the prefill
tok/s on the long prompts (a path's own last prefill call: a restore and the tail, a fork's child), the decode
tok/s of one stream, and whether it holds the bar for a default (top-1 >= 97%, mean KL <= 0.02 nats).
``results.json`` and ``results.md`` (``quality_report``) go to ``--out``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from headrace.bench.quality_engines import DISK_MIB, ENGINES, HOST_MIB, LLAMA_CONTEXTS, EngineConfig, PathScores

QUALITY = "quality"  # the benchmark's name on the ``headrace bench`` command line
QUANTIZATIONS = ("Q4_0", "none", "Q8_0", "F16")
DTYPES = ("auto", "float32")
ANSWER_TOKENS = 32


@dataclass
class QualityOptions:
    engines: list[str] = field(default_factory=lambda: list(ENGINES))
    quantize: list[str] = field(default_factory=lambda: list(QUANTIZATIONS))
    dtypes: list[str] = field(default_factory=lambda: list(DTYPES))
    prompts: int = 0  # 0: the whole set
    tokens: int = ANSWER_TOKENS
    paths: list[str] = field(default_factory=list)  # empty: every path
    paths_everywhere: bool = False
    seed: int = 0
    prompt_set: str = "main"  # or "held-out": prompts no choice was made on (headrace.quality.held_out)
    resume: bool = False  # keep the rows --out's results.json holds for the same prompts and answer length

    def check(self) -> None:
        from headrace.quality.paths import PATHS

        for name, values, allowed in (("--quality-engines", self.engines, ENGINES),
                                      ("--quality-paths", self.paths, PATHS)):
            bad = [v for v in values if v not in allowed]
            if bad:
                raise ValueError(f"{name}: unknown {bad}; choose from {', '.join(allowed)}")
        if not self.engines:
            raise ValueError("--quality-engines: at least one engine")
        from headrace.bench.quality_prompts import PROMPT_SETS

        if self.prompt_set not in PROMPT_SETS:
            raise ValueError(f"--quality-set: unknown {self.prompt_set!r}; choose from {', '.join(PROMPT_SETS)}")
        if self.prompts < 0 or self.tokens < 1:
            raise ValueError("--quality-prompts must be >= 0 (0: all) and --quality-tokens >= 1")


def add_arguments(p: Any) -> None:
    """The benchmark's flags on ``headrace bench``'s parser."""
    from headrace.quality.paths import PATHS

    d = QualityOptions()
    p.add_argument("--quality-engines", nargs="+", default=d.engines, metavar="ENGINE",
                   help=f"{QUALITY}: the LLM engines scored (default {' '.join(ENGINES)})")
    p.add_argument("--quality-quantize", nargs="+", default=d.quantize, metavar="TYPE",
                   help=f"{QUALITY}: llama-cpp quantizations, each converted from the installed file once (default "
                        f"{' '.join(QUANTIZATIONS)}; none: the file as installed)")
    p.add_argument("--quality-dtypes", nargs="+", default=d.dtypes, metavar="DTYPE",
                   help=f"{QUALITY}: torch dtypes (default {' '.join(DTYPES)})")
    p.add_argument("--quality-prompts", type=int, default=0, metavar="N",
                   help=f"{QUALITY}: prompts scored, every kind in turn (default 0: the whole fixed set, 252)")
    p.add_argument("--quality-tokens", type=int, default=ANSWER_TOKENS, metavar="N",
                   help=f"{QUALITY}: the reference's greedy answer per prompt, and the engines' "
                        f"(default {ANSWER_TOKENS})")
    p.add_argument("--quality-paths", nargs="+", default=[], metavar="PATH",
                   help=f"{QUALITY}: the KV paths scored on the config's own engine (default all: {' '.join(PATHS)})")
    p.add_argument("--quality-paths-everywhere", action="store_true",
                   help=f"{QUALITY}: every KV path on every engine configuration, not only the config's own")
    p.add_argument("--quality-set", default=d.prompt_set, metavar="SET",
                   help=f"{QUALITY}: the prompt set: main (252 prompts, what the default was chosen on) or held-out "
                        "(50 other chat prompts and another corpus's workflow prompts: a check of the choice)")
    p.add_argument("--quality-resume", action="store_true",
                   help=f"{QUALITY}: keep the rows results.json in --out already holds for the same prompt set and "
                        "answer length (each path is written there as it ends) and measure only the rest; a "
                        "phase's paths (cold, fork, pieces / prefix-hit, host, disk) are measured again together")


def options_from(args: Any) -> QualityOptions | str:
    from headrace.quality.paths import PATHS

    opts = QualityOptions(engines=list(args.quality_engines), quantize=list(args.quality_quantize),
                          dtypes=list(args.quality_dtypes), prompts=args.quality_prompts, tokens=args.quality_tokens,
                          paths=list(args.quality_paths or PATHS), paths_everywhere=args.quality_paths_everywhere,
                          seed=args.seed, prompt_set=getattr(args, "quality_set", "main"), resume=getattr(args, "quality_resume", False))
    try:
        opts.check()
    except ValueError as exc:
        return str(exc)
    return opts


def summarise(cfg: EngineConfig, path: str, acc: PathScores, ref_answers: list[list[int]],
              total: int) -> dict[str, Any]:
    """One table row: the path's quality and speed on this configuration."""
    from headrace.quality.metrics import identical_fraction, matching_prefix, summarize

    stats = summarize(acc.scores)
    idx = sorted(acc.answers)
    identical = identical_fraction([ref_answers[i] for i in idx], [acc.answers[i] for i in idx]) if idx else None
    leads = [matching_prefix(ref_answers[i], acc.answers[i]) for i in idx]
    by_kind = {}
    for kind in dict.fromkeys(acc.kinds):
        s = summarize(sc for sc, k in zip(acc.scores, acc.kinds) if k == kind)
        by_kind[kind] = {"prompts": acc.kinds.count(kind), "mean_kl": s.mean_kl, "top1": s.top1}
    return {"engine": cfg.plugin, "variant": cfg.variant, "default": cfg.default, "path": path, "note": cfg.note,
            "taken": len(acc.scores), "of": total, "not_taken": acc.not_taken[:10], **stats.as_dict(),
            "identical": identical, "answers_compared": len(idx),
            # What a user sees of a greedy answer: its first token, and how far it follows the reference's.
            "first_token": sum(n > 0 for n in leads) / len(leads) if leads else None,
            "mean_lead": sum(leads) / len(leads) if leads else None,
            "prefill_tok_s": acc.long_tokens / acc.long_seconds if acc.long_seconds else None,
            "decode_tok_s": acc.decode_tokens / acc.decode_seconds if acc.decode_seconds else None,
            "cached_tokens": acc.cached_tokens, "holds_bar": holds_bar(stats.top1, stats.mean_kl),
            "by_kind": by_kind}


BAR_TOP1, BAR_MEAN_KL = 0.97, 0.02  # issue 47's bar for a default


def holds_bar(top1: float, mean_kl: float) -> bool:
    return bool(top1 >= BAR_TOP1 and mean_kl <= BAR_MEAN_KL)


async def quality_phase(config_path: Path, cache_dir: Path, opts: QualityOptions, log: Callable[[str], None],
                        checkpoint: Callable[[dict[str, Any]], None] = lambda results: None,
                        previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole benchmark: the reference, then each configuration (the config's own first); the results as
    ``results.json`` holds them, also given to ``checkpoint`` as each path ends (a long run keeps what it measured).
    ``previous``: an earlier run's results, whose rows for the same prompts and answer length are kept (their
    phases not measured again)."""
    import anyio

    from headrace.bench.quality_engines import engine_configs, score_config
    from headrace.bench.quality_reference import load_reference
    from headrace.quality.paths import COLD, DISK, FORK, HOST, PATHS, PIECES, PREFIX_HIT

    configs, source = engine_configs(config_path, opts, cache_dir)
    configs.sort(key=lambda c: not c.default)  # stable: the rest in the order asked
    # The config's chat_template option, where the model has none (Gemma's GGUF): the prompts are rendered with it.
    from headrace.plugins.engines.llm.chat import read_template
    template = next((read_template(c.spec.options.get("chat_template"), "chat_template") for c in configs
                     if c.spec.options.get("chat_template")), None)
    ref = await anyio.to_thread.run_sync(lambda: load_reference(source, cache_dir, opts, log, template))
    prompts, answers, ref_rows = ref.prompts, ref.answers, ref.rows
    results: dict[str, Any] = {
        "rows": [], "engines": {}, "reference": ref.meta,
        "prompt_set": {"name": opts.prompt_set, "digest": prompts.digest, "prompts": len(prompts), "kinds": prompts.kinds(),
                       "prompt_tokens": sum(len(p.tokens) for p in prompts),
                       "longest": max(len(p.tokens) for p in prompts), "answer_tokens": opts.tokens},
        "options": dataclasses.asdict(opts),
        "configs": [{"label": c.label, "engine": c.plugin, "variant": c.variant, "default": c.default,
                     "options": dict(c.spec.options), "model": c.spec.model, "note": c.note} for c in configs],
        "bench_overrides": {"cold": f"prefix cache off, no tiers; llama-cpp n_seq_max {LLAMA_CONTEXTS} (one request "
                                    "at a time)",
                            "reuse": f"a prefix cache holding one prompt, kv_host_mib {HOST_MIB}, kv_disk_mib "
                                     f"{DISK_MIB}; disk: the same engine started again, kv_host_mib 0"},
        "done": []}
    kept: dict[tuple[str, str, str], dict[str, Any]] = {}
    if previous and previous.get("prompt_set", {}).get("digest") == prompts.digest \
            and previous["prompt_set"].get("answer_tokens") == opts.tokens:
        kept = {(r["engine"], r["variant"], r["path"]): r for r in previous.get("rows", [])}
        results["engines"] = dict(previous.get("engines", {}))
        log(f"resuming: {len(kept)} rows kept from {previous.get('meta', {}).get('time', 'an earlier run')}")
    order = {(c.plugin, c.variant, p): (i, PATHS.index(p)) for i, c in enumerate(configs) for p in PATHS}

    def put(row: dict[str, Any]) -> None:
        rows = [r for r in results["rows"] if (r["engine"], r["variant"], r["path"]) !=
                (row["engine"], row["variant"], row["path"])] + [row]
        results["rows"] = sorted(rows, key=lambda r: order.get((r["engine"], r["variant"], r["path"]), (99, 99)))

    for cfg in configs:
        wanted = [p for p in PATHS if p in opts.paths] if (cfg.default or opts.paths_everywhere) else [COLD]
        run: list[str] = []
        for phase in ((COLD, FORK, PIECES), (PREFIX_HIT, HOST, DISK)):
            mine = [p for p in wanted if p in phase]
            if any((cfg.plugin, cfg.variant, p) not in kept for p in mine):
                run += mine
            else:
                for p in mine:
                    put(kept[(cfg.plugin, cfg.variant, p)])

        def done(path: str, acc: PathScores, info: dict[str, Any], cfg: EngineConfig = cfg) -> None:
            row = summarise(cfg, path, acc, answers, len(prompts))
            row["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
            put(row)
            results["engines"][cfg.label] = {**results["engines"].get(cfg.label, {}), **info}
            log(f"  {cfg.label} {path}: mean KL {row['mean_kl']:.5f}, p99 {row['p99_kl']:.4f}, top-1 "
                f"{row['top1']:.3f}, identical {row['identical']}, taken {row['taken']}/{row['of']}")
            checkpoint(results)

        if run:
            await score_config(cfg, run, prompts, answers, ref_rows, ref.vocab, cache_dir, opts.tokens, log, done)
        results["done"].append(cfg.label)
        checkpoint(results)
    return results


def fixed_mmap_threshold(threshold: int = 1 << 20) -> None:
    """Allocations of ``threshold`` bytes or more come straight from mmap and go back on free (glibc's
    ``M_MMAP_THRESHOLD``, fixed). By default glibc raises the threshold to 32 MiB after the first big free, and the
    per-prompt rows (6-12 MB each, made and freed by two threads) then come from the heap, where the small tensors
    the run keeps pin them: measured 6 MB of RSS lost per prompt, 13 GB and an OOM kill over a whole run."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc: its own allocator's business
        pass


def command_line(args: Any, opts: QualityOptions) -> str:
    """The run's command, spelled out from its options (every flag, defaults too: the table says what ran)."""
    from headrace.daemon.config import default_config_path
    from headrace.quality.paths import PATHS

    parts = ["headrace bench quality"]
    if Path(args.config) != default_config_path():
        parts.append(f"--config {args.config}")
    parts.append(f"--quality-engines {' '.join(opts.engines)}")
    if "llama-cpp" in opts.engines:
        parts.append(f"--quality-quantize {' '.join(opts.quantize)}")
    if "torch" in opts.engines:
        parts.append(f"--quality-dtypes {' '.join(opts.dtypes)}")
    if opts.prompts:
        parts.append(f"--quality-prompts {opts.prompts}")
    parts.append(f"--quality-tokens {opts.tokens}")
    if list(opts.paths) != list(PATHS):
        parts.append(f"--quality-paths {' '.join(opts.paths)}")
    if opts.paths_everywhere:
        parts.append("--quality-paths-everywhere")
    if opts.seed:
        parts.append(f"--seed {opts.seed}")
    if opts.prompt_set != "main":
        parts.append(f"--quality-set {opts.prompt_set}")
    if opts.resume:
        parts.append("--quality-resume")
    return " ".join(parts + [f"--out {args.out}"])


def run_command(args: Any) -> int:
    """``headrace bench quality``: run it, write results.json and results.md to ``--out``."""
    import anyio
    import torch

    from headrace.bench.client import BenchError
    from headrace.bench.cpu import CPUWatch
    from headrace.bench.quality_report import describe_cpu, write
    from headrace.daemon.config import load_config

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    others = [w for w in args.workloads if w != QUALITY]
    if others:
        print(f"headrace bench: the quality benchmark runs alone (its engines run in this process): drop "
              f"{' '.join(others)}", file=sys.stderr)
        return 2
    if args.url:
        print("headrace bench: the quality benchmark runs its engines in this process (it needs their KV paths): "
              "drop --url", file=sys.stderr)
        return 2
    opts = options_from(args)
    if isinstance(opts, str):
        print(f"headrace bench: {opts}", file=sys.stderr)
        return 2
    from headrace.bench.subcommand import machine

    fixed_mmap_threshold()
    cache_dir = load_config(args.config).data.cache_path()
    t0 = time.perf_counter()
    cpu = CPUWatch()
    started = time.strftime("%Y-%m-%dT%H:%M:%S")

    def stamp(results: dict[str, Any]) -> dict[str, Any]:
        results["meta"] = {"machine": machine(), "cpu": describe_cpu(), "cpu_cores": cpu.cores(),
                           "torch_threads": torch.get_num_threads(), "elapsed_s": time.perf_counter() - t0,
                           "time": started, "argv": sys.argv[1:], "command": command_line(args, opts),
                           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
        return results

    previous = None
    if opts.resume:
        try:
            previous = json.loads((Path(args.out) / "results.json").read_text())
        except (OSError, ValueError):
            previous = None
    try:
        results = anyio.run(quality_phase, args.config, cache_dir, opts, lambda line: print(line, flush=True),
                            lambda partial: write(stamp(partial), args.out), previous)
    except (BenchError, ValueError) as exc:
        print(f"headrace bench: {exc}", file=sys.stderr)
        return 2
    files, text = write(stamp(results), args.out)
    print(text)
    print(f"wrote {', '.join(str(f) for f in files)}")
    return 0


from headrace.bench.quality_engines import cold_overrides, engine_configs, make_engine  # noqa: E402 (re-exported)

__all__ = ["QUALITY", "QualityOptions", "add_arguments", "options_from", "run_command", "quality_phase",
           "engine_configs", "make_engine", "cold_overrides", "holds_bar"]
