"""The quality benchmark's engine side: the configurations scored, their engines in this process, and each
configuration's KV paths run over the prompt set (``headrace.quality.paths``), one engine at a time.

Per configuration: ``cold``, ``fork`` and ``pieces`` on an engine whose prefix cache is off; ``prefix-hit`` and
``host`` on one whose prefix cache holds one prompt, with the KV tiers on; stopping it writes what its cells hold to
the disk tier, and ``disk`` restores each prompt on an engine started again on that data dir with no host tier.
Each engine's options are the configuration's with only those overrides (``cold_overrides``,
``paths.reuse_options``) and fewer sequences (one request at a time here).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ENGINES = ("llama-cpp", "torch")
HOST_MIB, DISK_MIB = 1024, 16384  # the reuse engine's tiers: host memory for a few prompts, disk for all
LLAMA_CONTEXTS = 4  # n_seq_max of the engines here (one request at a time): less KV allocated than the config's 32


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


def engine_configs(config_path: Path, opts: Any, cache_dir: Path) -> tuple[list[EngineConfig], Path]:
    """The configurations to score and the model file as installed (the reference's)."""
    from headrace.daemon.config import load_config
    from headrace.plugins.engines.llama_cpp.options import DEFAULT_MODEL
    from headrace.plugins.engines.models.paths import resolve_model
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
        if own is not None and "chat_template" in own.options:  # the model's template, whichever engine runs it
            base["chat_template"] = own.options["chat_template"]
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
    from headrace.plugins.engines.llama_cpp.files import QUANT_TYPES
    return QUANT_TYPES


def _llama_default_quantize() -> str:
    from headrace.plugins.engines.llama_cpp.options import DEFAULT_QUANTIZE
    return DEFAULT_QUANTIZE


def f16_file(source: Path, cache_dir: Path, threads: int) -> Path:
    """``source`` converted to F16 by llama.cpp once (as the engine converts to its types), cached beside them."""
    import ctypes

    from headrace.plugins.engines.llama_cpp.cpu import ProbeModel
    from headrace.plugins.engines.llama_cpp.files import llama
    from headrace.plugins.engines.models.loading import gguf_cache_key, made_once

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
        from headrace.plugins.engines.llama_cpp.engine import LlamaCppLLM
        return LlamaCppLLM(spec, env)
    from headrace.plugins.engines.torch_engine.engine import TorchLLM
    return TorchLLM(spec, env)


def cold_overrides(plugin: str) -> dict[str, Any]:
    """No prefix cache and no tiers: every prefill computes its whole prompt."""
    base: dict[str, Any] = {"prefix_cache_tokens": 0, "prefix_cache_pin_tokens": None, "kv_host_mib": None,
                            "kv_disk_mib": None}
    if plugin == "llama-cpp":
        base.update({"prefix_cache_sequences": 0, "n_seq_max": LLAMA_CONTEXTS})
    return base


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
                       vocab: int, cache_dir: Path, tokens: int, log: Callable[[str], None],
                       done: Callable[[str, PathScores, dict[str, Any]], None]) -> dict[str, Any]:
    """Every path of ``paths`` on ``cfg``, each handed to ``done`` (path, scores, what the engines said of
    themselves) as it ends; returns that last. Phases with none of ``paths`` are skipped."""
    from headrace.quality import paths as kv

    info: dict[str, Any] = {}
    order = list(range(len(prompts.prompts)))
    data = Path(tempfile.mkdtemp(prefix="headrace-quality-"))

    async def run(engine: Any, path: str, call: Callable, sequence: list[int] = order) -> None:
        acc = PathScores()
        await _each(prompts, sequence, path, acc, ref_rows, call, log, cfg.label)
        if path in (kv.PREFIX_HIT, kv.HOST, kv.DISK):
            info["disk_stats" if path == kv.DISK else "reuse_stats"] = _tier_stats(engine)
        done(path, acc, info)

    def answer(p: Any) -> list[int]:
        return answers[prompts.index[p.id]]

    try:
        first = [p for p in (kv.COLD, kv.FORK, kv.PIECES) if p in paths]
        if first:
            engine = make_engine(cfg.spec, data / "cold", cache_dir, **cold_overrides(cfg.plugin))
            calls = {kv.COLD: lambda p: kv.cold(engine, p.tokens, answer(p), greedy=tokens),
                     kv.FORK: lambda p: kv.fork(engine, p.tokens, answer(p), p.split, greedy=tokens),
                     kv.PIECES: lambda p: kv.pieces(engine, p.tokens, answer(p), p.pieces(), greedy=tokens)}

            async def cold_phase() -> None:
                _check_engine(engine, prompts, vocab, cfg)
                info.update(_engine_info(engine))
                for path in first:
                    await run(engine, path, calls[path])

            log(f"{cfg.label}: {', '.join(first)}")
            await serving(engine, cold_phase)
        reuse = [p for p in (kv.PREFIX_HIT, kv.HOST, kv.DISK) if p in paths]
        if reuse:
            room = kv.cells_room(max(len(p.tokens) for p in prompts.prompts))
            options = kv.reuse_options(cfg.plugin, room, HOST_MIB, DISK_MIB if kv.DISK in paths else 0)
            if cfg.plugin == "llama-cpp":
                options["n_seq_max"] = LLAMA_CONTEXTS
            engine = make_engine(cfg.spec, data / "reuse", cache_dir, **options)

            async def reuse_phase() -> None:
                _check_engine(engine, prompts, vocab, cfg)
                info.update(_engine_info(engine))
                evict = kv.evictor(engine, room)
                if kv.PREFIX_HIT in paths:
                    await run(engine, kv.PREFIX_HIT,
                              lambda p: kv.prefix_hit(engine, p.tokens, answer(p), greedy=tokens))
                if kv.HOST in paths:
                    await run(engine, kv.HOST, lambda p: kv.host(engine, p.tokens, answer(p), evict, greedy=tokens))
                if kv.PREFIX_HIT not in paths and kv.HOST not in paths:  # disk alone: the tiers still need filling
                    for p in prompts.prompts:
                        await kv.host(engine, p.tokens, answer(p), evict)

            log(f"{cfg.label}: {', '.join(p for p in reuse if p != kv.DISK) or 'filling the tiers'} (a prefix cache "
                f"of {room} tokens, tiers)")
            await serving(engine, reuse_phase)  # stopping writes the cells' prefixes to disk
            if kv.DISK in paths:
                restarted = make_engine(cfg.spec, data / "reuse", cache_dir, **{**options, "kv_host_mib": 0})
                # Shorter first: a prompt that begins a longer one is restored before the longer one's prefix sits
                # in the cells, where it would be a cells hit rather than a restore.
                by_length = sorted(order, key=lambda i: (len(prompts.prompts[i].tokens), i))

                async def disk_phase() -> None:
                    await run(restarted, kv.DISK, lambda p: kv.restored(restarted, p.tokens, answer(p), "disk",
                                                                        greedy=tokens), by_length)

                log(f"{cfg.label}: disk (an engine started again on the data dir the last one saved)")
                await serving(restarted, disk_phase)
    finally:
        shutil.rmtree(data, ignore_errors=True)
    return info


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


__all__ = ["ENGINES", "EngineConfig", "PathScores", "engine_configs", "make_engine", "cold_overrides", "f16_file",
           "serving", "score_config"]
