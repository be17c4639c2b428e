"""The quality benchmark's reference side: the prompt set, the reference's greedy answers (cached), and its rows.

The answers are cached under ``<cache dir>/quality/``, keyed by the model file's content digest, the prompt set's
hash and the answer length: they cost a greedy decode per prompt (minutes for the whole set on 2 cores). The rows
(a log-softmax over the vocabulary per answer token, what the KL needs: one teacher-forced forward pass per prompt)
are ``prompts x tokens x vocab`` float32, 1.6 GB for the whole set at 32 tokens (``meta["rows_bytes"]``): they are
written once to a raw file beside the answers and memory-mapped, so a run's resident memory does not hold them (the
kernel pages them in and out) and a resumed run does not compute them again.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch


@dataclass
class ReferenceData:
    prompts: Any  # PromptSet
    answers: list[list[int]]  # the reference's greedy answer per prompt, ``tokens`` long
    rows: list[torch.Tensor]  # per prompt (tokens, vocab): the distribution each answer token was drawn from
    vocab: int
    meta: dict[str, Any]


def load_reference(source: Path, cache_dir: Path, opts: Any, log: Callable[[str], None],
                   chat_template: str | None = None) -> ReferenceData:
    from headrace.bench.quality_prompts import quality_prompt_set
    from headrace.plugins.engines.models.loading import gguf_cache_key
    from headrace.quality.reference import Reference

    log(f"reference: transformers float32 on {source.name} (as installed) ...")
    ref = Reference.load(source)
    if chat_template is not None:  # the engine's chat_template option over the model's (or its lack of one)
        ref.tokenizer.chat_template = chat_template
    full = quality_prompt_set(ref.tokenizer, opts.seed, getattr(opts, "prompt_set", "main"))
    prompts = full.subset(opts.prompts) if opts.prompts else full
    log(f"reference: loaded in {ref.load_seconds:.1f} s; {len(prompts)} prompts (set {prompts.digest}, "
        f"{sum(len(p.tokens) for p in prompts)} tokens, kinds {prompts.kinds()})")
    key = f"{gguf_cache_key(source)}-{prompts.digest}-{opts.tokens}"
    file = cache_dir / "quality" / f"reference-{key}.json"
    meta: dict[str, Any] = {"model": str(source), "model_key": gguf_cache_key(source), "implementation":
                            "transformers float32", "load_s": ref.load_seconds, "answers_file": str(file),
                            "full_set": {"digest": full.digest, "prompts": len(full)}}
    answers = _cached(file, prompts, opts.tokens)
    meta["answers_cached"] = answers is not None
    if answers is None:
        t0 = time.perf_counter()
        answers = []
        for i, p in enumerate(prompts, 1):
            answers.append(ref.greedy(p.tokens, opts.tokens))
            if i % 25 == 0 or i == len(prompts):
                log(f"reference: greedy answers {i}/{len(prompts)} ({time.perf_counter() - t0:.0f} s)")
        meta["greedy_s"] = time.perf_counter() - t0
        _save(file, {"prompt_set": prompts.digest, "tokens": opts.tokens, "model_key": meta["model_key"],
                     "greedy_s": meta["greedy_s"], "answers": answers})
    eos = ref.eos_token_ids
    meta["answers_with_eos"] = sum(any(t in eos for t in a) for a in answers)
    t0 = time.perf_counter()
    rows = _rows_file(file.with_name(f"rows-{key}.f32"), prompts, answers, ref, log)
    meta["rows_s"] = time.perf_counter() - t0
    meta["rows_bytes"] = sum(r.numel() * r.element_size() for r in rows)
    meta["sample_answer"] = ref.tokenizer.decode(answers[0])
    vocab = ref.vocab_size
    del ref  # half a GB of float32 weights, not needed past here
    return ReferenceData(prompts, answers, rows, vocab, meta)


def _rows_file(file: Path, prompts: Any, answers: list[list[int]], ref: Any,
               log: Callable[[str], None]) -> list[torch.Tensor]:
    """Each prompt's (tokens, vocab) rows as views of ``file``, computed into it first where it is absent."""
    shape = (len(prompts), len(answers[0]), ref.vocab_size)
    if not file.exists() or file.stat().st_size != int(np.prod(shape)) * 4:
        file.parent.mkdir(parents=True, exist_ok=True)
        partial = file.with_name(f"{file.name}.{os.getpid()}.partial")
        out = np.memmap(partial, mode="w+", dtype=np.float32, shape=shape)
        t0 = time.perf_counter()
        for i, (p, answer) in enumerate(zip(prompts, answers), 1):
            # Row len(prompt) - 1 + j of the whole sequence is the distribution answer[j] was drawn from.
            out[i - 1] = ref.logprob_rows([*p.tokens, *answer[:-1]])[len(p.tokens) - 1:].numpy()
            if i % 50 == 0 or i == len(prompts):
                log(f"reference: rows {i}/{len(prompts)} ({time.perf_counter() - t0:.0f} s)")
        out.flush()
        del out
        partial.rename(file)  # whole or absent, as the answers
    else:
        log(f"reference: rows from {file}")
    # Copy-on-write: the views are writable (torch wants that) and nothing written reaches the file.
    mapped = np.memmap(file, mode="c", dtype=np.float32, shape=shape)
    return [torch.from_numpy(mapped[i]) for i in range(shape[0])]


def _cached(file: Path, prompts: Any, tokens: int) -> list[list[int]] | None:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    answers = data.get("answers")
    if (data.get("prompt_set") != prompts.digest or data.get("tokens") != tokens or not isinstance(answers, list)
            or len(answers) != len(prompts) or any(len(a) != tokens for a in answers)):
        return None
    return [[int(t) for t in a] for a in answers]


def _save(file: Path, data: dict[str, Any]) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    partial = file.with_name(f"{file.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(data))
    partial.rename(file)  # whole or absent: a crashed run leaves no half file


__all__ = ["ReferenceData", "load_reference"]
