"""``headrace check``'s numbers: each LLM engine's next-token distributions against a float32 reference.

That an engine runs proves little about what it computes: a kernel with a wrong shuffle, a CPU variant built with a
broken intrinsic or a bad build answers every prompt, wrongly. So for each LLM engine of the config (llama-cpp,
torch) a child process loads the engine as configured (its CPU variant, quantization, dtype and threads) and
scores fixed canary prompts: the model's chat template around four short chats, each followed by the reference's
own greedy answer, the engine's whole next-token distribution after the prompt and after each of the answer's
first tokens (teacher-forced: ``next_token_logits`` over the whole vocabulary, the batched path), then greedily
decodes each chat (the one-token decode path). The child compares them with reference rows stored in the cache
dir, computed once by ``headrace.quality.reference`` (transformers, float32) on the very file the engine serves
(the converted copy when ``quantize`` converts): the check measures the engine's kernels, build and dtype, not the
quantization. A wrong number fails the check as a SIGILL does, naming the engine, its CPU variant and the
measured mean KL and top-1 against the bounds; a child that dies is named by its signal.

The stored reference: ``<cache_dir>/quality/<file's content key>.<canary digest>.npz``, the canary token ids, the
reference's greedy answers and its log-softmax rows in float16 (4 chats x 16 positions x the vocabulary: 6.3 MB
for SmolLM2). Computing it takes 24 s once on the 2-core EPYC when quiet (transformers parses the GGUF; minutes on a
busy machine); the check then adds a child of about 10 s of CPU per engine (imports, load, 4 scored prefills, 32
decode steps).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Four chats: knowledge, code, arithmetic and a story, so that the positions span confident and open ones.
CANARY_CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France, and what river runs through it?"}],
    [{"role": "user", "content": "Write a Python function that returns the factorial of n."}],
    [{"role": "user", "content": "If a train travels 60 miles in 1.5 hours, what is its average speed?"}],
    [{"role": "user", "content": "Tell me a short story about a water wheel at an old mill."}],
]
POSITIONS = 16  # teacher-forced positions per chat: after the prompt, and after each of the first 15 answer tokens
CANARY_VERSION = 1  # bump when what is stored changes
CANARY_DIGEST = hashlib.sha256(json.dumps({"chats": CANARY_CHATS, "positions": POSITIONS,
                                           "version": CANARY_VERSION}, sort_keys=True).encode()).hexdigest()[:12]

# The bounds, from the floor measured on this project's 2-core AMD EPYC (Zen 4: avx2, avx512f/bw/vl/vnni/bf16, no amx),
# 2026-11-29, against the float32 reference on the file served (docs/deploy.md has the table and the command):
# - llama-cpp, every variant that loads (x64, haswell, icelake, zen4) x quantize none (Q4_1), Q4_0, Q8_0: mean KL
#   0.0024 to 0.0031 nats, max per position 0.032, top-1 58 to 63 of 64, greedy answers left the reference's where it
#   nearly tied (0.20 nats at most), the chosen tokens' decode log-probabilities 0.18 nats off at most. The floor is
#   llama.cpp's arithmetic (activations quantized to 8 bits for its dot products, an f16 KV cache), not the weights:
#   Q8_0 sits on it as Q4_1 does;
# - torch: float32 1e-7 nats (transformers both sides), bfloat16 0.0008, top-1 63 of 64.
# Wrong numbers measured with the same check: the Q4_0 copy's weights against the Q4_1 file's reference 0.32 nats
# (top-1 78%, a greedy answer 1.24 nats off), one layer's ffn_down rows reversed 0.70 (layer 20) to 10.5 (layer 0);
# one layer's ffn_norm scaled by 1.1 gave 0.010. So: a mean KL bound 6x above the highest floor and 16x below a
# served-the-wrong-weights error; top-1 may lose twice the positions the worst floor lost (top-1 alone is coarse:
# 64 positions, near ties); a decode 5x the floor's gap and log-probability error.
MAX_MEAN_KL = 0.02  # nats
MIN_TOP1 = 0.8
# A greedy decode may leave the reference's answer only where the reference itself nearly tied: the token the engine
# picked is at most this many nats below the reference's best there.
MAX_DIVERGENCE_GAP = 1.0
MAX_DECODE_LOGPROB_ERROR = 1.0  # nats: a decoded token's log-probability against the reference's, on its path
DECODE_TOKENS = 8  # greedy tokens per chat through the decode path (at most POSITIONS)

CHILD_SECONDS = 900.0  # a first check converts the model and computes the reference (a minute or two)
LLM_PLUGINS = ("llama-cpp", "torch")


@dataclass
class QualityResult:
    ok: bool
    detail: str
    stats: dict[str, Any] | None = None
    crashed: bool = False  # the child died or failed: it cannot run, which is not the same fault as wrong numbers


def reference_file(cache_dir: Path, served: Path) -> Path:
    """Where the reference rows for ``served`` (the file an engine loads) and the canary set are kept."""
    from headrace.plugins.engines.models.loading import gguf_cache_key

    return cache_dir / "quality" / f"{gguf_cache_key(served)}.{CANARY_DIGEST}.npz"


def check_options(plugin: str, options: dict[str, Any]) -> dict[str, Any]:
    """The engine's options, sized for a check: the same numerics (quantization, dtype, threads, batch shape, KV
    layout), a context and KV cells enough for the canaries, no prefix cache and no KV tiers (nothing touches the
    data dir, nothing 2.6 GB is allocated)."""
    opts = dict(options)
    opts["prefix_cache_tokens"] = 0
    opts.pop("kv_host_mib", None)
    opts.pop("kv_disk_mib", None)
    opts.pop("prefix_cache_pin_tokens", None)  # at most the prefix cache's tokens: 0 now
    opts["max_context_tokens"] = min(int(opts.get("max_context_tokens", 2048)), 512)
    if plugin == "llama-cpp":
        opts["n_seq_max"] = 1
        opts["prefix_cache_sequences"] = 0
        opts.pop("n_ctx", None)
    return opts


def check_quality(name: str, plugin: str, model: str | None, options: dict[str, Any], cache_dir: Path,
                  library: Path | None = None, timeout: float = CHILD_SECONDS) -> QualityResult:
    """The engine's numbers against the reference, in a child process (``library``: the llama.cpp CPU variant)."""
    from headrace.plugins.engines.llama_cpp.cpu import VARIANT_ENV, cpu_flags, exit_cause, stderr_tail

    job = {"name": name, "plugin": plugin, "model": model, "options": check_options(plugin, options),
           "cache_dir": str(cache_dir)}
    env = dict(os.environ)
    if library is not None:
        env[VARIANT_ENV] = str(library)  # the variant the chooser proved: loaded without a probe
    argv = [sys.executable, "-X", "faulthandler", "-m", __name__, json.dumps(job)]
    t0 = time.monotonic()
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return QualityResult(False, f"its numbers' check gave no answer in {timeout:.0f} s", crashed=True)
    seconds = time.monotonic() - t0
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return QualityResult(False, f"its numbers' check {exit_cause(done.returncode)} ({cpu_flags()}): "
                                    f"{stderr_tail(done.stderr, 4)}", crashed=True)
    stats = json.loads(lines[-1])
    if stats.get("unchecked"):  # no reference for this file: not this machine's fault, so not a failure
        return QualityResult(True, f"numbers not checked: {stats['unchecked']}", stats)
    return judge(stats, seconds)


def judge(stats: dict[str, Any], seconds: float = math.nan) -> QualityResult:
    """Within the bounds or not, in one line that names what was measured."""
    variant, s, d = stats["variant"], stats["scored"], stats["decode"]
    problems = []
    if stats.get("error"):
        problems.append(stats["error"])
    else:
        if s["tokens"] < stats["expected"]:
            problems.append(f"{stats['expected'] - s['tokens']} of {stats['expected']} positions had no score")
        if not s["mean_kl"] <= MAX_MEAN_KL:  # NaN fails too
            problems.append(f"mean KL {s['mean_kl']:.4g} nats > bound {MAX_MEAN_KL}")
        if not s["top1"] >= MIN_TOP1:
            problems.append(f"top-1 {s['top1']:.1%} < bound {MIN_TOP1:.0%}")
        if not d["max_gap"] <= MAX_DIVERGENCE_GAP:
            problems.append(f"a greedy decode took a token {d['max_gap']:.3g} nats below the reference's best "
                            f"(bound {MAX_DIVERGENCE_GAP})")
        if not d["max_logprob_delta"] <= MAX_DECODE_LOGPROB_ERROR:
            problems.append(f"a decoded token's log-probability is {d['max_logprob_delta']:.3g} nats off the "
                            f"reference's (bound {MAX_DECODE_LOGPROB_ERROR})")
    measured = (f"mean KL {s['mean_kl']:.2g} nats (p99 {s['p99_kl']:.2g}, max {s['max_kl']:.2g}; bound "
                f"{MAX_MEAN_KL}), top-1 {s['top1']:.1%} (bound {MIN_TOP1:.0%}) over {s['tokens']} positions, "
                f"greedy answers {d['identical']}/{d['answers']} identical") if s else "nothing measured"
    where = f"{variant} on {stats['file']}"
    timing = f"; {seconds:.1f} s" if math.isfinite(seconds) else ""
    made = f", reference computed now ({stats['reference_seconds']:.0f} s)" if stats.get("reference_seconds") else ""
    if problems:
        return QualityResult(False, f"WRONG NUMBERS on {where}: {'; '.join(problems)} (measured: {measured}; "
                                    f"against the float32 reference{made}{timing})", stats)
    return QualityResult(True, f"numbers on {where}: {measured} against the float32 reference{made}{timing}",
                         stats)


# ----- the child process ---------------------------------------------------------------------------


def make_reference(served: Path, target: Path) -> float:
    """Compute and store the reference rows for ``served``: the seconds it took (0 when another process did)."""
    from headrace.plugins.engines.models.loading import made_once

    took = [0.0]

    def make(partial: Path) -> None:
        import numpy as np
        import torch
        import transformers

        from headrace.quality.reference import Reference

        t0 = time.monotonic()
        ref = Reference.load(served)
        prompts, answers, rows = [], [], []
        for chat in CANARY_CHATS:
            prompt = ref.chat_tokens(chat)
            answer = ref.greedy(prompt, POSITIONS)
            full = ref.logprob_rows(prompt + answer)
            rows.append(full[len(prompt) - 1:len(prompt) - 1 + POSITIONS].to(torch.float16).numpy())
            prompts.append(np.asarray(prompt, dtype=np.int64))
            answers.append(np.asarray(answer, dtype=np.int64))
        took[0] = time.monotonic() - t0
        meta = {"file": served.name, "canary": CANARY_DIGEST, "transformers": transformers.__version__,
                "torch": torch.__version__, "load_seconds": round(ref.load_seconds, 1),
                "seconds": round(took[0], 1)}
        with open(partial, "wb") as f:  # a file object: np.savez would add ".npz" to the partial's name
            np.savez(f, rows=np.stack(rows), answers=np.stack(answers), meta=json.dumps(meta),
                     **{f"prompt{i}": p for i, p in enumerate(prompts)})

    made_once(target, Path.exists, make)
    return took[0]


def load_reference(path: Path) -> dict[str, Any]:
    import numpy as np

    with np.load(path) as z:
        chats = z["rows"].shape[0]
        return {"rows": z["rows"], "answers": z["answers"].tolist(), "meta": json.loads(str(z["meta"])),
                "prompts": [z[f"prompt{i}"].tolist() for i in range(chats)]}


def _make_engine(job: dict[str, Any], data_dir: Path) -> Any:
    from headrace.plugins.protocols import EngineEnv, EngineSpec

    spec = EngineSpec(job["name"], job["plugin"], job["model"], job["options"])

    def lookup(other: str) -> Any:
        raise LookupError(f"engine {other!r}: not loaded by the check")

    env = EngineEnv(data_dir=data_dir, cache_dir=Path(job["cache_dir"]), lookup=lookup)
    if job["plugin"] == "llama-cpp":
        from headrace.plugins.engines.llama_cpp.engine import LlamaCppLLM

        return LlamaCppLLM(spec, env)
    from headrace.plugins.engines.torch_engine.engine import TorchLLM

    return TorchLLM(spec, env)


def _variant(engine: Any) -> str:
    if engine.__class__.__name__ == "LlamaCppLLM":
        from headrace.plugins.engines.llama_cpp.cpu import loaded_variant, variant_name

        library = loaded_variant()
        return f"CPU backend {variant_name(library) if library else 'chosen by ggml'}"
    import torch

    dtype = str(next(engine.core.model.parameters()).dtype).removeprefix("torch.")
    return f"torch {dtype} ({torch.backends.cpu.get_cpu_capability()} kernels)"


async def measure(engine: Any, served: Path, reference: dict[str, Any]) -> dict[str, Any]:
    """Score the canaries on a running engine and compare them with ``reference`` (``load_reference``'s)."""
    import torch

    from headrace.plugins.protocols import SamplingParams
    from headrace.quality.metrics import compare, matching_prefix, summarize

    rows = torch.from_numpy(reference["rows"]).to(torch.float32)  # (chats, positions, vocab)
    vocab = rows.shape[-1]
    result: dict[str, Any] = {"variant": _variant(engine), "file": served.name, "expected": rows.shape[0] * POSITIONS,
                              "scored": {}, "decode": {}}
    if engine.vocab_size != vocab:
        result["error"] = f"the engine's vocabulary is {engine.vocab_size} tokens, the reference's {vocab}"
        return result
    engine_rows = await _teacher_forced(engine, reference["prompts"], reference["answers"], vocab)
    scores = [compare(rows[c], engine_rows[c]) for c in range(rows.shape[0])]
    result["scored"] = summarize(scores).as_dict()
    # The decode path: each chat alone (one row per step), greedy, EOS not ending it, as the reference's answer.
    identical, max_gap, max_delta = 0, 0.0, 0.0
    for c, (prompt, answer) in enumerate(zip(reference["prompts"], reference["answers"])):
        params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
        tokens, logprobs = [], []
        async for delta in engine.generate(prompt, params):
            tokens += delta.token_ids
            logprobs += [lp.logprob for lp in delta.logprobs]
        answer = answer[:DECODE_TOKENS]
        same = matching_prefix(answer, tokens)
        identical += same == len(answer) == len(tokens)
        ref_lp = torch.log_softmax(rows[c].to(torch.float64), dim=-1)
        for j in range(min(same, len(logprobs))):  # on the reference's path: the chosen token's log-probability
            max_delta = max(max_delta, abs(logprobs[j] - float(ref_lp[j, tokens[j]])))
        if same < min(len(answer), len(tokens)):  # where it left it: how far below the reference's best it went
            max_gap = max(max_gap, float(ref_lp[same].max() - ref_lp[same, tokens[same]]))
    result["decode"] = {"answers": len(reference["answers"]), "identical": identical, "max_gap": max_gap,
                        "max_logprob_delta": max_delta}
    return result


async def _teacher_forced(engine: Any, prompts: list[list[int]], answers: list[list[int]], vocab: int) -> Any:
    """(chats, POSITIONS, vocab): the engine's distribution after each prompt and each of its answer's first tokens.

    One scored prefill per chat where the engine scores prompts teacher-forced (``ScoresPrompts``: the prefill path,
    every row in one pass); else a prompt per position through ``next_token_logits`` (the same path, about three
    times the tokens: the positions share their prefix, but each recomputes its own tail)."""
    import anyio
    import torch

    if callable(getattr(engine, "prompt_logprobs", None)):
        out: list[Any] = [None] * len(prompts)

        async def score(c: int) -> None:
            scored = await engine.prompt_logprobs(prompts[c] + answers[c][:POSITIONS], full=True)
            out[c] = scored.rows[len(prompts[c]):len(prompts[c]) + POSITIONS]

        async with anyio.create_task_group() as tg:  # side by side: one batch, as a server's scoring would run
            for c in range(len(prompts)):
                tg.start_soon(score, c)
        return torch.stack(out)
    logits = await engine.next_token_logits([p + a[:j] for p, a in zip(prompts, answers) for j in range(POSITIONS)],
                                            range(vocab))
    return logits.reshape(len(prompts), POSITIONS, vocab)


def _served_file(engine: Any, job: dict[str, Any]) -> Path:
    """The file the engine loaded: llama.cpp's converted copy, or the configured one (torch dequantises it)."""
    if getattr(engine.core, "model_file", None):
        return Path(engine.core.model_file)
    from headrace.plugins.engines.models.paths import resolve_model
    from headrace.plugins.engines.torch_engine.engine import DEFAULT_MODEL

    return resolve_model(job["model"] or DEFAULT_MODEL)


async def _child_main(job: dict[str, Any]) -> dict[str, Any]:
    import anyio

    with tempfile.TemporaryDirectory(prefix="headrace-check-") as data_dir:
        engine = _make_engine(job, Path(data_dir))
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            try:
                served = _served_file(engine, job)
                if not (served.is_file() and served.suffix == ".gguf"):
                    return {"unchecked": f"the float32 reference reads GGUF files, and {served} is not one"}
                target = reference_file(Path(job["cache_dir"]), served)
                made = 0.0
                if not target.exists():
                    print(f"computing the float32 reference for {served.name} (once)", file=sys.stderr, flush=True)
                    try:
                        made = await anyio.to_thread.run_sync(make_reference, served, target)
                    except Exception as exc:  # transformers cannot read this file (its architecture, its types)
                        log.warning("no float32 reference for %s", served, exc_info=True)
                        return {"unchecked": f"transformers cannot make the float32 reference from {served.name} "
                                             f"({type(exc).__name__}: {str(exc)[:200]})"}
                result = await measure(engine, served, load_reference(target))
                result["reference_seconds"] = round(made, 1)
                return result
            finally:
                tg.cancel_scope.cancel()


if __name__ == "__main__":
    import anyio

    from headrace.plugins.engines.llama_cpp.cpu import _no_core_dump

    _no_core_dump()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level="WARNING", format="%(message)s")
    outcome = anyio.run(_child_main, json.loads(sys.argv[1]))
    print(json.dumps(outcome), flush=True)
