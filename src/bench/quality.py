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
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

QUALITY = "quality"  # the benchmark's name on the ``headrace bench`` command line
ENGINES = ("llama-cpp", "torch")
QUANTIZATIONS = ("Q4_0", "none", "Q8_0", "F16")
DTYPES = ("auto", "float32")
ANSWER_TOKENS = 32
HOST_MIB, DISK_MIB = 1024, 16384  # the reuse engine's tiers: host memory for a few prompts, disk for all
LLAMA_CONTEXTS = 4  # n_seq_max of the engines here (one request at a time): less KV allocated than the config's 32


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

    def check(self) -> None:
        from headrace.quality.paths import PATHS

        for name, values, allowed in (("--quality-engines", self.engines, ENGINES),
                                      ("--quality-paths", self.paths, PATHS)):
            bad = [v for v in values if v not in allowed]
            if bad:
                raise ValueError(f"{name}: unknown {bad}; choose from {', '.join(allowed)}")
        if not self.engines:
            raise ValueError("--quality-engines: at least one engine")
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


def options_from(args: Any) -> QualityOptions | str:
    from headrace.quality.paths import PATHS

    opts = QualityOptions(engines=list(args.quality_engines), quantize=list(args.quality_quantize),
                          dtypes=list(args.quality_dtypes), prompts=args.quality_prompts, tokens=args.quality_tokens,
                          paths=list(args.quality_paths or PATHS), paths_everywhere=args.quality_paths_everywhere,
                          seed=args.seed)
    try:
        opts.check()
    except ValueError as exc:
        return str(exc)
    return opts


# ----- engine configurations ----------------------------------------------------------------------


@dataclass
class EngineConfig:
    plugin: str
    variant: str  # the llama-cpp quantization or the torch dtype
    spec: Any  # EngineSpec, options as configured plus the variant
    default: bool  # the config's own LLM engine, as configured
    note: str = ""  # how the variant was made, where it was not the engine's own option

    @property
    def label(self) -> str:
        return f"{self.plugin} {self.variant}"


def engine_configs(config_path: Path, opts: QualityOptions, cache_dir: Path) -> tuple[list[EngineConfig], Path]:
    """The configurations to score and the model file as installed (the reference's)."""
    from headrace.daemon.config import load_config
    from headrace.plugins.engines.llama_cpp_options import DEFAULT_MODEL
    from headrace.plugins.engines.model_paths import resolve_model
    from headrace.plugins.protocols import EngineSpec

    config = load_config(config_path)
    own = next((e for e in config.engines if e.plugin in ENGINES), None)
    model = own.model if own is not None and own.model else DEFAULT_MODEL
    source = resolve_model(model)
    threads = (own.options.get("threads") if own is not None else None) or len(os.sched_getaffinity(0))
    own_variant = None
    if own is not None:
        own_variant = str(own.options.get("quantize", _llama_default_quantize())) if own.plugin == "llama-cpp" \
            else str(own.options.get("dtype", "auto"))
    out = []
    for plugin in opts.engines:
        base = dict(own.options) if own is not None and own.plugin == plugin else {"threads": threads}
        for variant in (opts.quantize if plugin == "llama-cpp" else opts.dtypes):
            options, spec_model, note = {**base}, model, ""
            if plugin == "llama-cpp":
                options["quantize"] = variant
                if variant not in ("none", *_quant_types()):
                    if variant != "F16":
                        raise ValueError(f"--quality-quantize: unknown type {variant!r}")
                    # The engine's quantize option has no F16 (yet): the same conversion, made here.
                    spec_model, options["quantize"] = str(f16_file(source, cache_dir, threads)), "none"
                    note = "converted here (llama_model_quantize, ftype F16): the engine's quantize has no F16"
            else:
                options["dtype"] = variant
            spec = EngineSpec(name=own.name if own is not None else "llm", plugin=plugin, model=spec_model,
                              options=options)
            out.append(EngineConfig(plugin, variant, spec, own is not None and own.plugin == plugin
                                    and variant == own_variant, note))
    return out, source


def _quant_types() -> dict[str, int]:
    from headrace.plugins.engines.llama_cpp_files import QUANT_TYPES
    return QUANT_TYPES


def _llama_default_quantize() -> str:
    from headrace.plugins.engines.llama_cpp_options import DEFAULT_QUANTIZE
    return DEFAULT_QUANTIZE


def f16_file(source: Path, cache_dir: Path, threads: int) -> Path:
    """``source`` converted to F16 by llama.cpp once (as the engine converts to its types), cached beside them."""
    import ctypes

    from headrace.plugins.engines.llama_cpp_cpu import ProbeModel
    from headrace.plugins.engines.llama_cpp_files import llama
    from headrace.plugins.engines.torch_loading import gguf_cache_key, made_once

    target = cache_dir / "models" / f"{gguf_cache_key(source)}.F16.gguf"

    def convert(partial: Path) -> None:
        lc = llama(ProbeModel(source, cache_dir, "none", threads))
        params = lc.llama_model_quantize_default_params()
        params.ftype, params.nthread, params.allow_requantize = 1, threads, True  # LLAMA_FTYPE_MOSTLY_F16
        if lc.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama.cpp could not convert {source} to F16")

    return made_once(target, Path.exists, convert)


def make_engine(spec: Any, data_dir: Path, cache_dir: Path, **overrides: Any) -> Any:
    """The engine of ``spec`` with ``overrides`` on its options (None removes one), in this process."""
    from headrace.plugins.protocols import EngineEnv, EngineSpec

    options = {k: v for k, v in {**spec.options, **overrides}.items() if v is not None}
    env = EngineEnv(data_dir=data_dir, cache_dir=cache_dir, lookup=lambda name: None)
    spec = EngineSpec(name=spec.name, plugin=spec.plugin, model=spec.model, options=options)
    if spec.plugin == "llama-cpp":
        from headrace.plugins.engines.llama_cpp import LlamaCppLLM
        return LlamaCppLLM(spec, env)
    from headrace.plugins.engines.torch_llm import TorchLLM
    return TorchLLM(spec, env)


def cold_overrides(plugin: str) -> dict[str, Any]:
    """No prefix cache and no tiers: every prefill computes its whole prompt."""
    base: dict[str, Any] = {"prefix_cache_tokens": 0, "prefix_cache_pin_tokens": None, "kv_host_mib": None,
                            "kv_disk_mib": None}
    if plugin == "llama-cpp":
        base.update({"prefix_cache_sequences": 0, "n_seq_max": LLAMA_CONTEXTS})
    return base


# ----- the run ------------------------------------------------------------------------------------


@dataclass
class PathScores:
    """One configuration's one path over the prompt set, as it is scored."""

    scores: list[Any] = field(default_factory=list)  # TokenScores per prompt taken
    kinds: list[str] = field(default_factory=list)
    answers: dict[int, list[int]] = field(default_factory=dict)  # prompt index -> the engine's greedy answer
    not_taken: list[str] = field(default_factory=list)
    long_tokens: int = 0
    long_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    cached_tokens: int = 0


async def serving(engine: Any, scenario: Callable[[], Any]) -> Any:
    import anyio

    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        try:
            return await scenario()
        finally:
            tg.cancel_scope.cancel()


def _record(acc: PathScores, i: int, prompt: Any, run: Any, ref_rows: Any) -> None:
    from headrace.quality.metrics import compare

    acc.scores.append(compare(ref_rows, run.rows))
    acc.kinds.append(prompt.kind)
    acc.cached_tokens += run.cached
    if run.greedy is not None:
        acc.answers[i] = run.greedy
        acc.decode_tokens += run.decode_tokens
        acc.decode_seconds += run.decode_s
    if prompt.kind == "long":
        acc.long_tokens += run.prompt_tokens
        acc.long_seconds += run.prefill_s


async def _each(prompts: Any, order: list[int], path: str, acc: PathScores, ref_rows: list, call: Callable,
                log: Callable[[str], None], label: str) -> None:
    from headrace.quality.paths import PathNotTaken

    t0 = time.perf_counter()
    for done, i in enumerate(order, 1):
        prompt = prompts.prompts[i]
        try:
            run = await call(prompt)
        except PathNotTaken as exc:
            acc.not_taken.append(f"{prompt.id}: {exc}")
            continue
        _record(acc, i, prompt, run, ref_rows[i])
        if done % 25 == 0 or done == len(order):
            log(f"  {label} {path}: {done}/{len(order)} ({time.perf_counter() - t0:.0f} s)")


async def score_config(cfg: EngineConfig, paths: list[str], prompts: Any, answers: list[list[int]], ref_rows: list,
                       vocab: int, cache_dir: Path, tokens: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Every path of ``paths`` on ``cfg``: {path: PathScores}, and what the engines said of themselves."""
    from headrace.quality import paths as kv

    found: dict[str, PathScores] = {}
    info: dict[str, Any] = {}
    order = list(range(len(prompts.prompts)))
    data = Path(tempfile.mkdtemp(prefix="headrace-quality-"))
    try:
        engine = make_engine(cfg.spec, data / "cold", cache_dir, **cold_overrides(cfg.plugin))

        async def cold_phase() -> None:
            _check_engine(engine, prompts, vocab, cfg)
            info.update(_engine_info(engine))
            for path in (p for p in (kv.COLD, kv.FORK, kv.PIECES) if p in paths):
                acc = found[path] = PathScores()
                calls = {kv.COLD: lambda p: kv.cold(engine, p.tokens, answers[_index(prompts, p)], greedy=tokens),
                         kv.FORK: lambda p: kv.fork(engine, p.tokens, answers[_index(prompts, p)], p.split,
                                                    greedy=tokens),
                         kv.PIECES: lambda p: kv.pieces(engine, p.tokens, answers[_index(prompts, p)], p.pieces(),
                                                        greedy=tokens)}
                await _each(prompts, order, path, acc, ref_rows, calls[path], log, cfg.label)

        log(f"{cfg.label}: {', '.join(p for p in paths if p in (kv.COLD, kv.FORK, kv.PIECES))}")
        await serving(engine, cold_phase)
        del engine
        reuse = [p for p in (kv.PREFIX_HIT, kv.HOST, kv.DISK) if p in paths]
        if reuse:
            room = kv.cells_room(max(len(p.tokens) for p in prompts.prompts))
            options = kv.reuse_options(cfg.plugin, room, HOST_MIB, DISK_MIB if kv.DISK in paths else 0)
            if cfg.plugin == "llama-cpp":
                options["n_seq_max"] = LLAMA_CONTEXTS
            engine = make_engine(cfg.spec, data / "reuse", cache_dir, **options)

            async def reuse_phase() -> dict[str, Any]:
                _check_engine(engine, prompts, vocab, cfg)
                evict = kv.evictor(engine, room)
                if kv.PREFIX_HIT in paths:
                    await _each(prompts, order, kv.PREFIX_HIT, found.setdefault(kv.PREFIX_HIT, PathScores()), ref_rows,
                                lambda p: kv.prefix_hit(engine, p.tokens, answers[_index(prompts, p)], greedy=tokens),
                                log, cfg.label)
                if kv.HOST in paths:
                    await _each(prompts, order, kv.HOST, found.setdefault(kv.HOST, PathScores()), ref_rows,
                                lambda p: kv.host(engine, p.tokens, answers[_index(prompts, p)], evict, greedy=tokens),
                                log, cfg.label)
                return _tier_stats(engine)

            log(f"{cfg.label}: {', '.join(p for p in reuse if p != kv.DISK)} (prefix cache of {room} tokens, tiers)")
            info["reuse_stats"] = await serving(engine, reuse_phase)  # stopping writes the cells' prefixes to disk
            del engine
            if kv.DISK in paths:
                restarted = make_engine(cfg.spec, data / "reuse", cache_dir, **{**options, "kv_host_mib": 0})
                # Shorter first: a prompt that begins a longer one is restored before the longer one's prefix sits
                # in the cells, where it would be a cells hit rather than a restore.
                by_length = sorted(order, key=lambda i: (len(prompts.prompts[i].tokens), i))

                async def disk_phase() -> dict[str, Any]:
                    await _each(prompts, by_length, kv.DISK, found.setdefault(kv.DISK, PathScores()), ref_rows,
                                lambda p: kv.restored(restarted, p.tokens, answers[_index(prompts, p)], "disk",
                                                      greedy=tokens), log, cfg.label)
                    return _tier_stats(restarted)

                log(f"{cfg.label}: disk (an engine started again on the data dir the last one saved)")
                info["disk_stats"] = await serving(restarted, disk_phase)
    finally:
        shutil.rmtree(data, ignore_errors=True)
    return {"paths": found, "info": info}


def _index(prompts: Any, prompt: Any) -> int:
    return prompts.index[prompt.id]


def _check_engine(engine: Any, prompts: Any, vocab: int, cfg: EngineConfig) -> None:
    from headrace.bench.client import BenchError

    bad = prompts.check_engine(engine)
    if bad:
        raise BenchError(f"{cfg.label}: its tokenizer makes other token ids of {len(bad)} prompts "
                         f"({', '.join(bad[:5])}): it would be scored on prompts it never sees")
    if engine.vocab_size != vocab:
        raise BenchError(f"{cfg.label}: logits of {engine.vocab_size} tokens, the reference's {vocab}")


def _engine_info(engine: Any) -> dict[str, Any]:
    core = engine.core
    info: dict[str, Any] = {}
    if getattr(core, "model_file", None) is not None:
        info["model_file"] = str(core.model_file)
    model = getattr(core, "model", None)
    if model is not None and hasattr(model, "dtype"):
        info["dtype"] = str(model.dtype).removeprefix("torch.")
    return info


def _tier_stats(engine: Any) -> dict[str, Any]:
    return {k: v for k, v in engine.stats().items() if k.startswith(("kv_store_", "prefix_cache_hits",
                                                                    "prefix_cache_queries"))}


def summarise(cfg: EngineConfig, path: str, acc: PathScores, ref_answers: list[list[int]],
              total: int) -> dict[str, Any]:
    """One table row: the path's quality and speed on this configuration."""
    from headrace.quality.metrics import identical_fraction, summarize

    stats = summarize(acc.scores)
    idx = sorted(acc.answers)
    identical = identical_fraction([ref_answers[i] for i in idx], [acc.answers[i] for i in idx]) if idx else None
    by_kind = {}
    for kind in dict.fromkeys(acc.kinds):
        s = summarize(sc for sc, k in zip(acc.scores, acc.kinds) if k == kind)
        by_kind[kind] = {"prompts": acc.kinds.count(kind), "mean_kl": s.mean_kl, "top1": s.top1}
    return {"engine": cfg.plugin, "variant": cfg.variant, "default": cfg.default, "path": path, "note": cfg.note,
            "taken": len(acc.scores), "of": total, "not_taken": acc.not_taken[:10], **stats.as_dict(),
            "identical": identical, "answers_compared": len(idx),
            "prefill_tok_s": acc.long_tokens / acc.long_seconds if acc.long_seconds else None,
            "decode_tok_s": acc.decode_tokens / acc.decode_seconds if acc.decode_seconds else None,
            "cached_tokens": acc.cached_tokens, "holds_bar": holds_bar(stats.top1, stats.mean_kl),
            "by_kind": by_kind}


BAR_TOP1, BAR_MEAN_KL = 0.97, 0.02  # issue 47's bar for a default


def holds_bar(top1: float, mean_kl: float) -> bool:
    return bool(top1 >= BAR_TOP1 and mean_kl <= BAR_MEAN_KL)


async def quality_phase(config_path: Path, cache_dir: Path, opts: QualityOptions, log: Callable[[str], None],
                        checkpoint: Callable[[dict[str, Any]], None] = lambda results: None) -> dict[str, Any]:
    """The whole benchmark: the reference, then each configuration (the config's own first); the results as
    ``results.json`` holds them, also given to ``checkpoint`` after each configuration (a long run keeps what it
    measured)."""
    import anyio

    from headrace.bench.quality_reference import load_reference
    from headrace.quality.paths import PATHS

    configs, source = engine_configs(config_path, opts, cache_dir)
    configs.sort(key=lambda c: not c.default)  # stable: the rest in the order asked
    ref = await anyio.to_thread.run_sync(lambda: load_reference(source, cache_dir, opts, log))
    prompts, answers, ref_rows = ref.prompts, ref.answers, ref.rows
    results: dict[str, Any] = {
        "rows": [], "engines": {}, "reference": ref.meta,
        "prompt_set": {"digest": prompts.digest, "prompts": len(prompts), "kinds": prompts.kinds(),
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
    for cfg in configs:
        paths = [p for p in PATHS if p in opts.paths] if (cfg.default or opts.paths_everywhere) else ["cold"]
        measured = await score_config(cfg, paths, prompts, answers, ref_rows, ref.vocab, cache_dir, opts.tokens, log)
        results["engines"][cfg.label] = measured["info"]
        for path in paths:
            row = summarise(cfg, path, measured["paths"][path], answers, len(prompts))
            results["rows"].append(row)
            log(f"  {cfg.label} {path}: mean KL {row['mean_kl']:.5f}, p99 {row['p99_kl']:.4f}, top-1 "
                f"{row['top1']:.3f}, identical {row['identical']}, taken {row['taken']}/{row['of']}")
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

    try:
        results = anyio.run(quality_phase, args.config, cache_dir, opts, lambda line: print(line, flush=True),
                            lambda partial: write(stamp(partial), args.out))
    except (BenchError, ValueError) as exc:
        print(f"headrace bench: {exc}", file=sys.stderr)
        return 2
    files, text = write(stamp(results), args.out)
    print(text)
    print(f"wrote {', '.join(str(f) for f in files)}")
    return 0


__all__ = ["QUALITY", "QualityOptions", "add_arguments", "options_from", "run_command", "quality_phase",
           "engine_configs", "make_engine", "cold_overrides", "holds_bar"]
