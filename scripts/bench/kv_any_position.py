"""Documents at any position: how close does reusing a document's KV away from the prompt's prefix come to a
full prefill, on llama.cpp and the default model (issue 42, part 3)?

Prompts are naive_rag's one-shot synthesis (the built-in template's text, in the engine's chat frame) over
chunks of the bench corpus (src/bench/corpus.py), 3-4 chunks a query drawn with Zipf-like popularity (a
chunk that documents the question's topic always among them). Every variant builds the same token sequence
(each text piece and document tokenized alone, as a reusing engine must) and is compared with a full
prefill of it: greedy answer agreement (teacher-forced on the reference's greedy answer, so positions align:
an answer is identical when every position's argmax is the reference's token) and the mean KL(ref || variant)
of next-token distributions over the answer positions, in nats. Variants:

- full_segmented (a control, first --control-queries only): the prompt prefilled in the pieces a reuse plan makes (the numeric noise floor);
- shift_only (a control, likewise): the whole prompt prefilled at position +4096, then shifted back (RoPE re-rotation alone);
- reuse_pos0 / reuse_sys: each document's KV computed alone at position 0 / after the template's constant
  prefix, restored and shifted into place, no repair (kv_blend with recompute_first = 0);
- epic_sys_kN (N = 4, 16, 32), epic_pos0_k16: as above, each document's first N tokens prefilled again in place (EPIC);
- docs_first: (d) the template with the question moved after the documents (documents then follow the
  constant prefix exactly), full prefill, against the current template's reference;
- docs_first_reuse_sys / _k16: that template's own reuse, against its own full prefill.

Usage: OMP_NUM_THREADS=2 .venv/bin/python scripts/bench/kv_any_position.py --queries 30 --out kv.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from headrace.bench.corpus import build_corpus
from headrace.graph.ops import chunk_text
from headrace.graph.prompts import PLACEHOLDER, SENTINEL
from headrace.graph.workflows.common import ONE_SHOT
from headrace.plugins.engines.llama_cpp import kv_blend
from headrace.plugins.engines.llm.chat import apply_template
from headrace.plugins.engines.llama_cpp.files import default_cache_dir, llama, load_tokenizer, quantized_model
from headrace.plugins.engines.llama_cpp.cpu import ProbeModel
from headrace.plugins.engines.llama_cpp.options import DEFAULT_MODEL, DEFAULT_QUANTIZE
from headrace.plugins.engines.models.paths import resolve_model

from benchlib import cpu_name  # beside this script

# (d): the same lines, the question moved after the documents (RAGCache's order: documents an exact prefix).
DOCS_FIRST = ("Answer the question using the contexts.\nContexts:\n{{input:contexts}}\n"
              "Question: {{input:question}}\nAnswer: {{output:answer}}")
assert sorted(DOCS_FIRST.split("\n")) == sorted(ONE_SHOT.split("\n"))
N_BATCH = 512  # the engine's max_batch_tokens
TARGET, SCRATCH, REF = 0, 1, 2
SHIFT_OFFSET = 4096


@dataclass
class Prompt:
    const: list[int]  # the template's text before its first placeholder, in the chat frame
    tokens: list[int]  # the whole prompt
    docs: list[tuple[int, int, int]]  # (chunk id, position, length)


class Model:
    def __init__(self, threads: int, n_ctx: int) -> None:
        path = resolve_model(DEFAULT_MODEL)
        cache = default_cache_dir()
        self.lc = lc = llama(ProbeModel(path, cache, DEFAULT_QUANTIZE, threads))
        self.tokenizer = load_tokenizer(path, cache)
        self.file = quantized_model(path, cache, DEFAULT_QUANTIZE, threads)
        self.model = lc.llama_model_load_from_file(str(self.file).encode(), lc.llama_model_default_params())
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        params = lc.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = n_ctx, N_BATCH, N_BATCH, 4
        params.kv_unified = True  # kv_blend's placement needs it (see its docstring)
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, params)
        self.mem = lc.llama_get_memory(self.ctx)
        self.batch = lc.llama_batch_init(N_BATCH, 0, 1)
        self.eos = {self.tokenizer.eos_token_id, lc.llama_vocab_eos(lc.llama_model_get_vocab(self.model))}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def clear(self, seq: int = -1) -> None:
        self.lc.llama_memory_seq_rm(self.mem, seq, -1, -1)

    def logits(self, row: int, n: int = 1) -> np.ndarray:
        buf = np.ctypeslib.as_array(self.lc.llama_get_logits(self.ctx), shape=(row + n, self.n_vocab))
        return buf[row:row + n].astype(np.float64)

    def decode_all(self, seq: int, tokens: list[int], start: int) -> np.ndarray:
        """Decode ``tokens`` (fewer than N_BATCH) with logits at every one."""
        b = self.batch
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, start + i, 1, True
            b.seq_id[i][0] = seq
        b.n_tokens = len(tokens)
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        return self.logits(0, len(tokens))


def chat_frame(model: Model) -> tuple[str, str]:
    head, _, tail = apply_template(model.tokenizer, [{"role": "user", "content": SENTINEL}], None,
                                   tokenize=False).partition(SENTINEL)
    return head, tail


def make_prompt(model: Model, template: str, question: str, chunk_ids: list[int], chunk_tokens: dict,
                frame: tuple[str, str]) -> Prompt:
    """The template rendered as prompts.py does (documents joined by blank lines, the answer's trailing space
    dropped), each text piece and each document tokenized alone."""
    head, tail = frame
    first = PLACEHOLDER.search(template)
    const = model.encode(head + template[:first.start()])
    tokens, docs, text = list(const), [], ""
    rest = template[first.start():]
    pieces = re.split(r"(\{\{(?:input|output):\w+\}\})", rest)
    for piece in pieces:
        m = PLACEHOLDER.fullmatch(piece)
        if not m:
            text += piece
        elif m.group(2) == "question":
            text += question
        elif m.group(2) == "contexts":
            for j, cid in enumerate(chunk_ids):
                text += "\n\n" if j else ""
                tokens += model.encode(text) if text else []
                text = ""
                docs.append((cid, len(tokens), len(chunk_tokens[cid])))
                tokens += chunk_tokens[cid]
        else:  # the output: the prompt ends here
            text = text.rstrip(" ")
    tokens += model.encode(text + tail)
    return Prompt(const, tokens, docs)


def reference(model: Model, p: Prompt, max_new: int) -> tuple[list[int], np.ndarray, float]:
    """Full prefill: greedy answer, then the teacher-forced distributions over it; and the prefill's time."""
    model.clear(REF)
    t0 = time.perf_counter()
    kv_blend.prefill(model.ctx, model.batch, REF, p.tokens, 0, N_BATCH, logits_last=True)
    wall = time.perf_counter() - t0
    logits = model.logits(0)[0]
    answer = []
    for i in range(max_new):
        tok = int(np.argmax(logits))
        answer.append(tok)
        if tok in model.eos:
            break
        logits = model.decode_all(REF, [tok], len(p.tokens) + i)[0]
    dists = teacher_forced(model, REF, p.tokens, answer)
    return answer, dists, wall  # REF still holds the prompt (the caller clears it)


def teacher_forced(model: Model, seq: int, tokens: list[int], answer: list[int]) -> np.ndarray:
    """Logits at each answer position, the sequence holding ``tokens`` but the last (which is decoded here)."""
    model.lc.llama_memory_seq_rm(model.mem, seq, len(tokens) - 1, -1)
    return model.decode_all(seq, [tokens[-1], *answer[:-1]], len(tokens) - 1)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare(answer: list[int], ref: np.ndarray, var: np.ndarray) -> dict:
    """Greedy agreement as the teacher-forced argmax of both sides (the same numeric path: a sequential
    greedy decode and a batched teacher-forced one may split a near-tie differently, which the full prefill's
    own row, ``full_prefill``, reports), and KL(ref || var) per answer position."""
    greedy, target = np.argmax(var, axis=-1), np.argmax(ref, axis=-1)
    agree = next((i for i in range(len(answer)) if greedy[i] != target[i]), len(answer))
    lp, lq = log_softmax(ref), log_softmax(var)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    return {"exact": agree == len(answer), "agree_tokens": agree, "answer_tokens": len(answer),
            "kl": float(kl.mean()), "kl_max": float(kl.max())}


def build_variant(model: Model, p: Prompt, name: str, cache: dict, chunk_tokens: dict) -> tuple[int, float]:
    """Build the prompt but its last token in TARGET the way ``name`` does; (tokens prefilled, wall seconds).
    Cache builds (a document computed alone, once) are not timed: they happen at ingest or first use."""
    model.clear(TARGET)
    body = p.tokens[:-1]
    if name == "shift_only":
        t0 = time.perf_counter()
        kv_blend.prefill(model.ctx, model.batch, TARGET, body, SHIFT_OFFSET, N_BATCH)
        model.lc.llama_memory_seq_add(model.mem, TARGET, SHIFT_OFFSET, SHIFT_OFFSET + len(body), -SHIFT_OFFSET)
        return len(p.tokens), time.perf_counter() - t0
    if name == "full_segmented":
        steps = kv_blend.plan(len(p.tokens), [(pos, n) for _, pos, n in p.docs], 0)
        t0 = time.perf_counter()
        for s in steps:
            end = min(s.end, len(body))
            if end > s.start:
                kv_blend.prefill(model.ctx, model.batch, TARGET, body[s.start:end], s.start, N_BATCH)
        return len(p.tokens), time.perf_counter() - t0
    m = re.fullmatch(r"(?:reuse|epic)_(pos0|sys)(?:_k(\d+))?", name)
    base, k = m.group(1), int(m.group(2) or 0)
    prefix = p.const if base == "sys" else []
    docs = []
    for cid, pos, _ in p.docs:
        key = (cid, tuple(prefix))
        if key not in cache:
            cache[key] = kv_blend.compute_doc(model.ctx, model.batch, SCRATCH, chunk_tokens[cid], N_BATCH, prefix)
        docs.append((cache[key], pos))
    t0 = time.perf_counter()
    steps = kv_blend.plan(len(p.tokens), [(pos, d.length) for d, pos in docs], k)
    prefilled = 1  # the last token, decoded with the answer
    for s in steps:
        if s.kind == "place":
            cached, pos = docs[s.doc]
            kv_blend.place(model.ctx, TARGET, SCRATCH, cached, pos, s)
        else:
            end = min(s.end, len(body))
            if end > s.start:
                kv_blend.prefill(model.ctx, model.batch, TARGET, body[s.start:end], s.start, N_BATCH)
                prefilled += end - s.start
    return prefilled, time.perf_counter() - t0


def draw_queries(model: Model, n: int, seed: int, chunk_words: int) -> tuple[list, dict, list]:
    corpus = build_corpus(seed=seed, n_documents=4, n_questions=n)
    chunks = []  # (document index, text)
    for d, doc in enumerate(corpus.documents):
        chunks += [(d, c) for c in chunk_text(doc.text, chunk_words, 0)]
    chunk_tokens = {i: model.encode(text) for i, (_, text) in enumerate(chunks)}
    rng = random.Random(seed)
    ranking = list(range(len(chunks)))
    rng.shuffle(ranking)  # popularity rank -> chunk
    weights = [1 / (r + 1) ** 1.1 for r in range(len(ranking))]
    queries = []
    for q in corpus.questions:
        relevant = [i for i, (d, text) in enumerate(chunks) if d == q.document and q.topic in text] or \
                   [i for i, (d, _) in enumerate(chunks) if d == q.document]
        ids = [rng.choice(relevant)]
        want = rng.choice((3, 4))
        while len(ids) < want:
            c = ranking[rng.choices(range(len(ranking)), weights)[0]]
            if c not in ids:
                ids.append(c)
        rng.shuffle(ids)
        queries.append((q.text, ids))
    return queries, chunk_tokens, chunks




VARIANTS = ("full_segmented", "shift_only", "reuse_pos0", "reuse_sys", "epic_pos0_k16", "epic_sys_k4",
            "epic_sys_k16", "epic_sys_k32")
CONTROLS = ("full_segmented", "shift_only")  # full prefills: run on the first --control-queries only
DOCS_FIRST_VARIANTS = ("reuse_sys", "epic_sys_k16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queries", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new", type=int, default=28, help="answer tokens (greedy, stops at EOS)")
    ap.add_argument("--chunk-words", type=int, default=110, help="words per chunk (~150-200 tokens)")
    ap.add_argument("--control-queries", type=int, default=8, help="queries that also run the two controls")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("kv_any_position.json"))
    args = ap.parse_args()
    model = Model(args.threads, n_ctx=3072)  # a K-shift rotates every cell: keep it small
    frame = chat_frame(model)
    queries, chunk_tokens, chunks = draw_queries(model, args.queries, args.seed, args.chunk_words)
    cache: dict = {}
    rows: dict[str, list[dict]] = {}

    def record(name: str, cmp: dict, prefilled: int, wall: float) -> None:
        rows.setdefault(name, []).append({**cmp, "prefilled": prefilled, "wall_s": wall})

    def summarize() -> dict:
        summary = {}
        for name, rs in rows.items():
            summary[name] = {
                "exact_share": sum(r["exact"] for r in rs) / len(rs),
                "agree_tokens_mean": float(np.mean([r["agree_tokens"] for r in rs])),
                "answer_tokens_mean": float(np.mean([r["answer_tokens"] for r in rs])),
                "kl_mean": float(np.mean([r["kl"] for r in rs])),
                "kl_max": float(max(r["kl_max"] for r in rs)),
                "prefilled_mean": float(np.mean([r["prefilled"] for r in rs])),
                "wall_ms_mean": 1000 * float(np.mean([r["wall_s"] for r in rs])),
                "holds_bar": sum(r["exact"] for r in rs) / len(rs) >= 0.95 and float(np.mean([r["kl"] for r in rs])) <= 0.05,
            }
        return summary

    started = time.perf_counter()
    for qi, (question, ids) in enumerate(queries):
        p = make_prompt(model, ONE_SHOT, question, ids, chunk_tokens, frame)
        answer, ref, wall = reference(model, p, args.max_new)
        model.clear(REF)
        # the reference's sequential greedy answer against its own teacher-forced argmax
        own = np.argmax(ref, axis=-1)
        same = next((i for i, t in enumerate(answer) if own[i] != t), len(answer))
        record("full_prefill", {"exact": same == len(answer), "agree_tokens": same, "answer_tokens": len(answer),
                                "kl": 0.0, "kl_max": 0.0}, len(p.tokens), wall)
        for name in VARIANTS:
            if name in CONTROLS and qi >= args.control_queries:
                continue
            prefilled, wall = build_variant(model, p, name, cache, chunk_tokens)
            record(name, compare(answer, ref, teacher_forced(model, TARGET, p.tokens, answer)), prefilled, wall)
        # (d) the reordered template: its full prefill against the current one's reference (same answer
        # positions), then reuse inside the reordered template against its own full prefill.
        q = make_prompt(model, DOCS_FIRST, question, ids, chunk_tokens, frame)
        answer_b, ref_b, wall_b = reference(model, q, args.max_new)
        same = answer_b == answer
        agree = next((i for i, (a, b) in enumerate(zip(answer, answer_b)) if a != b), min(len(answer), len(answer_b)))
        dists = teacher_forced(model, REF, q.tokens, answer)
        model.clear(REF)
        cmp = compare(answer, ref, dists)  # KL on the current template's answer positions
        record("docs_first", {**cmp, "exact": same, "agree_tokens": agree}, len(q.tokens), wall_b)
        for name in DOCS_FIRST_VARIANTS:
            prefilled, wall = build_variant(model, q, name, cache, chunk_tokens)
            record(f"docs_first_{name}", compare(answer_b, ref_b, teacher_forced(model, TARGET, q.tokens, answer_b)),
                   prefilled, wall)
        print(f"query {qi + 1}/{len(queries)}: {len(p.tokens)} tokens, {len(ids)} chunks, "
              f"{time.perf_counter() - started:.0f} s", flush=True)
        args.out.with_suffix(".partial.json").write_text(json.dumps({"queries_done": qi + 1, "summary": summarize()}))
    summary = summarize()

    print(f"\n{'variant':28} {'exact':>6} {'agree':>11} {'KL mean':>9} {'KL max':>8} {'prefilled':>9} "
          f"{'wall ms':>8} bar")
    for name, s in summary.items():
        print(f"{name:28} {s['exact_share']:6.0%} {s['agree_tokens_mean']:5.1f}/{s['answer_tokens_mean']:<5.1f} "
              f"{s['kl_mean']:9.4f} {s['kl_max']:8.3f} {s['prefilled_mean']:9.0f} {s['wall_ms_mean']:8.0f} "
              f"{'yes' if s['holds_bar'] else 'no'}")
    out = {"command": "OMP_NUM_THREADS=%s %s" % (os.environ.get("OMP_NUM_THREADS", "?"), " ".join(["scripts/bench/kv_any_position.py", *os.sys.argv[1:]])),
           "date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "model": str(model.file),
           "queries": len(queries), "chunks": len(chunks), "docs_computed": len(cache),
           "doc_tokens_computed": sum(d.length for d in cache.values()), "summary": summary, "rows": rows}
    args.out.write_text(json.dumps(out, indent=1))
    print(f"\n{out['cpu']}; {len(cache)} documents computed alone once ({out['doc_tokens_computed']} tokens); "
          f"wrote {args.out}")


if __name__ == "__main__":
    main()
