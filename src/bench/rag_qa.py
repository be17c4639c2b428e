"""``headrace bench rag-qa``: what a retrieval prompt's layout costs in answers, scored on a task.

Extractive questions over standard-library docstrings (``headrace.quality.qa``: "What does module.name return?",
the gold answer a span of its docstring), each asked with three retrieved chunks as ``naive_rag``'s one-shot
synthesis renders them (the workflows' chunking, template and chat frame): the chunk holding the answer and two
from other modules, the answer's chunk at a seeded position. Each mode renders or serves the same question its own
way; every answer is the engine's greedy decode (at most ``--qa-tokens``, ending at EOS), its first line scored by
exact match and token F1 against the gold span. Paired by question, so a mode's F1 is compared with
``question-first``'s (the workflows' default) with a bootstrap interval on the difference.

Modes:

- ``question-first``: the template as the workflows render it by default (the question before the contexts);
- ``context-first``: the contexts before the question (``context_first = true``): a chunk then starts the
  prompt after the fixed instruction, so its KV is an exact prefix later prompts reuse;
- ``canonical``: ``context-first`` with the chunks in a canonical order (sorted by their text's hash) rather than
  the retriever's rank: the same chunks then make the same prefix whatever their rank (RAGBoost's lossless
  reuse).
- ``pieces``: ``question-first`` with each chunk tokenized alone where it stands (as a workflow with
  ``place_documents`` tokenizes it), prefilled whole: the tokenization's own effect;
- ``placed``: those tokens with the chunks placed from KV computed alone beforehand (the llama-cpp engine's
  ``place_documents``: restored, shifted, each chunk's first 16 tokens recomputed in place), scored against
  ``question-first`` and, for the placement alone, ``pieces``;
- ``pieces-context-first`` / ``placed-context-first``: the same two with the contexts before the question (the
  workflows' default layout): a placed chunk then lacks its attention to the chunks before it, never to the
  question, which comes after and is computed in place; ``placed-context-first`` is scored against
  ``pieces-context-first``;
- ``leaf-question-first`` / ``leaf-context-first``: ``naive_rag``'s tree leaf (its default synthesis: one prompt
  per context, then a combine that sees no context), over the answer's chunk alone, in either order: the
  leaves' layout scored apart from the one-shot's, each against ``leaf-question-first``.

Runs the config's LLM engine in this process, its prefix cache off: every prompt is prefilled whole, so the
answers differ by layout alone. With ``placed`` the cache is on (the chunks' KV is kept in its KV tiers) and
every other prompt is prefilled in a cache partition of its own, so nothing else is reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

RAG_QA = "rag-qa"  # the benchmark's name on the ``headrace bench`` command line
MODES = ("question-first", "context-first", "canonical", "pieces", "placed", "pieces-context-first",
         "placed-context-first", "leaf-question-first", "leaf-context-first")
PLACED, PIECES = "placed", "pieces"
PLACED_CF, PIECES_CF = "placed-context-first", "pieces-context-first"
PLACED_MODES, PIECES_MODES = (PLACED, PLACED_CF), (PIECES, PIECES_CF)
TOKENIZED_ALONE = (*PIECES_MODES, *PLACED_MODES)  # each chunk tokenized alone where it stands
PLACED_PARTITION = "rag-qa-placed"
DEFAULT_MODES = tuple(m for m in MODES if m not in TOKENIZED_ALONE)  # placement: its own options
LEAF = "leaf-"  # a leaf mode's prefix: scored against leaf-question-first
# Pure-Python modules beside the corpus's whose docstrings give more "Return X." questions (those that have any).
EXTRA_MODULES = ("posixpath", "ipaddress", "secrets", "platform", "sysconfig", "traceback", "locale", "codecs",
                 "urllib.request", "os", "importlib.util", "importlib.metadata", "re", "site", "ast", "itertools",
                 "collections")
CONTEXTS = 3  # naive_rag's top-k
BOOTSTRAP = 2000


@dataclass
class QAOptions:
    modes: list[str] = field(default_factory=lambda: list(DEFAULT_MODES))
    questions: int = 0  # 0: all
    tokens: int = 32
    recompute: int = 16  # ``placed``: each chunk's first tokens computed in place (place_recompute_tokens)
    select: str = "first"  # ``placed`` on torch: how more tokens are chosen to compute again (place_select)
    select_ratio: float = 0.15  # ... and their share of the placed tokens (place_select_ratio)
    select_layer: int = 1  # ... on which layer they are chosen (place_select_layer)

    @property
    def placing(self) -> bool:
        """Some mode places chunks: the engine runs with ``place_documents`` and the KV tiers."""
        return any(m in PLACED_MODES for m in self.modes)

    def check(self) -> None:
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ValueError(f"--qa-modes: unknown {bad or 'none'}; choose from {', '.join(MODES)}")
        if self.questions < 0 or self.tokens < 1 or self.recompute < 0:
            raise ValueError("--qa-questions must be >= 0 (0: all), --qa-tokens >= 1 and --qa-recompute >= 0")
        if not 0 <= self.select_ratio <= 1 or self.select_layer < 1:
            raise ValueError("--qa-select-ratio must be from 0 to 1 and --qa-select-layer >= 1")


def add_arguments(p: Any) -> None:
    d = QAOptions()
    p.add_argument("--qa-modes", nargs="+", default=d.modes, metavar="MODE",
                   help=f"{RAG_QA}: the prompt layouts scored, of {' '.join(MODES)} "
                        f"(default {' '.join(DEFAULT_MODES)})")
    p.add_argument("--qa-questions", type=int, default=d.questions, metavar="N",
                   help=f"{RAG_QA}: questions asked (default 0: all)")
    p.add_argument("--qa-tokens", type=int, default=d.tokens, metavar="N",
                   help=f"{RAG_QA}: the longest answer decoded (default {d.tokens})")
    p.add_argument("--qa-recompute", type=int, default=d.recompute, metavar="N",
                   help=f"{RAG_QA}: placed: each chunk's first tokens computed in place (default {d.recompute})")
    p.add_argument("--qa-select", choices=("first", "deviation", "relevance"), default=d.select,
                   help=f"{RAG_QA}: placed, torch engine: how more tokens are chosen to compute again "
                        f"(place_select; default {d.select})")
    p.add_argument("--qa-select-ratio", type=float, default=d.select_ratio, metavar="R",
                   help=f"{RAG_QA}: placed, torch engine: the share of placed tokens computed again "
                        f"(place_select_ratio; default {d.select_ratio})")
    p.add_argument("--qa-select-layer", type=int, default=d.select_layer, metavar="N",
                   help=f"{RAG_QA}: placed, torch engine: the layer the tokens are chosen on "
                        f"(place_select_layer; default {d.select_layer})")


@dataclass(frozen=True)
class QAPrompt:
    item: Any  # QAItem
    contexts: tuple[str, ...]  # the retrieved chunks in the retriever's order, the answer's among them
    home: int  # the answer's chunk's place in ``contexts``


def qa_prompts(seed: int = 0) -> list[QAPrompt]:
    """Every question with its three chunks, fixed by ``seed``."""
    from headrace.bench.corpus import MODULES, _sections
    from headrace.bench.quality_prompts import CHUNK_OVERLAP, CHUNK_WORDS
    from headrace.graph.ops import chunk_text
    from headrace.quality.qa import returns_items

    rng = random.Random(seed)
    chunks: dict[str, list[str]] = {}
    items = []
    for module in dict.fromkeys([*MODULES, *EXTRA_MODULES]):
        sections = _sections(module)
        chunks[module] = chunk_text("\n\n".join(s for _, s in sections), CHUNK_WORDS, CHUNK_OVERLAP)
        items += [(module, it) for it in returns_items(sections)]
    out = []
    for module, item in items:
        home = next((c for c in chunks[module] if item.section[:200] in c and item.gold in c), None)
        if home is None:  # the docstring straddles two windows: no one chunk answers it
            continue
        others = [c for m, cs in chunks.items() if m != module for c in cs]
        contexts = rng.sample(others, CONTEXTS - 1)
        place = rng.randrange(CONTEXTS)
        contexts.insert(place, home)
        out.append(QAPrompt(item, tuple(contexts), place))
    return out


def render(prompt: QAPrompt, mode: str, frame: tuple[str, str]) -> str:
    from headrace.graph.prompts import PromptTemplate
    from headrace.graph.workflows.common import ANSWER, ONE_SHOT, answer_context_first, one_shot_context_first

    head, tail = frame
    if mode.startswith(LEAF):
        template = ANSWER if mode == "leaf-question-first" else answer_context_first.prompt
        values = {"question": prompt.item.question, "context": prompt.contexts[prompt.home]}
        return head + PromptTemplate(template).render(values) + tail
    contexts = list(prompt.contexts)
    if mode in TOKENIZED_ALONE:  # marks where each chunk goes: tokenized alone (``tokenize_documents``)
        from headrace.graph.prompts import document_marks
        contexts = document_marks(contexts)
    if mode == "canonical":
        contexts.sort(key=lambda c: hashlib.sha256(c.encode()).hexdigest())
    template = ONE_SHOT if mode in ("question-first", PIECES, PLACED) else one_shot_context_first.prompt
    return head + PromptTemplate(template).render({"question": prompt.item.question, "contexts": contexts}) + tail


async def answer(engine: Any, tokens: list[int], max_tokens: int, **prefill: Any) -> tuple[str, float]:
    from contextlib import aclosing

    from headrace.plugins.protocols import SamplingParams

    ctx = engine.new_context_id()
    t0 = time.perf_counter()
    try:
        await engine.prefill(ctx, tokens, None, **prefill)
        text = []
        async with aclosing(engine.decode(ctx, SamplingParams(max_tokens=max_tokens, temperature=0))) as stream:
            async for delta in stream:
                text.append(delta.text)
        return "".join(text), time.perf_counter() - t0
    finally:
        await engine.free(ctx)


def paired_interval(a: list[float], b: list[float], seed: int = 0) -> tuple[float, float, float]:
    """mean(b - a) and its 95% bootstrap interval over the pairs."""
    diffs = [y - x for x, y in zip(a, b)]
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(BOOTSTRAP))
    return sum(diffs) / n, means[int(0.025 * BOOTSTRAP)], means[int(0.975 * BOOTSTRAP) - 1]


def own_engine(config_path: Path, cache_dir: Path) -> Any:
    """The config's LLM engine (llama-cpp or torch) as configured, as the quality benchmark makes it."""
    from headrace.bench.quality import QualityOptions
    from headrace.bench.quality_engines import ENGINES, engine_configs
    from headrace.daemon.config import load_config
    from headrace.plugins.engines.llama_cpp.options import DEFAULT_QUANTIZE

    own = next((e for e in load_config(config_path).engines if e.plugin in ENGINES), None)
    plugin = own.plugin if own is not None else "llama-cpp"
    options = own.options if own is not None else {}
    variant = str(options.get("quantize", DEFAULT_QUANTIZE) if plugin == "llama-cpp" else options.get("dtype", "auto"))
    return engine_configs(config_path, QualityOptions(engines=[plugin], quantize=[variant], dtypes=[variant]),
                          cache_dir)[0][0]


async def qa_phase(config_path: Path, cache_dir: Path, opts: QAOptions, seed: int,
                   log: Callable[[str], None]) -> dict[str, Any]:
    from headrace.bench.quality_engines import cold_overrides, make_engine, serving
    from headrace.graph.prompts import chat_frame, tokenize_documents
    from headrace.quality.qa import answer_text, exact_match, mean, token_f1

    cfg = own_engine(config_path, cache_dir)
    prompts = qa_prompts(seed)
    if opts.questions:
        prompts = prompts[: opts.questions]
    data = Path(os.environ.get("TMPDIR", "/tmp")) / f"headrace-rag-qa-{os.getpid()}"
    overrides = cold_overrides(cfg.plugin)
    placing = opts.placing
    if placing:  # the chunks' KV kept in the tiers; everything else in a partition of its own
        if cfg.plugin not in ("llama-cpp", "torch"):
            raise ValueError(f"--qa-modes {PLACED} / {PLACED_CF}: only the llama-cpp and torch engines place documents, "
                             f"not {cfg.plugin}")
        overrides.update({"prefix_cache_tokens": None, "kv_host_mib": 2048, "kv_disk_mib": 0,
                          "place_documents": True, "place_recompute_tokens": opts.recompute})
        if cfg.plugin == "llama-cpp":
            overrides["prefix_cache_sequences"] = None
        elif opts.select != "first":
            overrides.update({"place_select": opts.select, "place_select_ratio": opts.select_ratio,
                              "place_select_layer": opts.select_layer})
        if cfg.plugin != "torch" and opts.select != "first":
            raise ValueError(f"--qa-select {opts.select}: only the torch engine chooses tokens to compute again")
    engine = make_engine(cfg.spec, data, cache_dir, **overrides)
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in opts.modes}
    placement: dict[str, Any] = {}  # the engine's placement counters, with ``placed``

    async def scenario() -> None:
        frame = chat_frame(engine, None)
        t0 = time.perf_counter()
        for i, p in enumerate(prompts, 1):
            for mode in opts.modes:
                prefill: dict[str, Any] = {}
                if mode in TOKENIZED_ALONE:
                    tokens, spans = tokenize_documents(engine, render(p, mode, frame), list(p.contexts))
                else:
                    tokens = list(engine.prompt_tokens(render(p, mode, frame)))
                if mode in PLACED_MODES:  # the chunks computed beforehand, as an ingest does (not timed)
                    await engine.prepare_documents([tokens[s:s + n] for s, n in spans],
                                                   cache_partition=PLACED_PARTITION)
                    prefill = {"documents": spans, "cache_partition": PLACED_PARTITION}
                elif placing:
                    prefill = {"cache_partition": f"rag-qa-{mode}-{i}"}
                text, seconds = await answer(engine, tokens, opts.tokens, **prefill)
                said = answer_text(text)
                rows[mode].append({"topic": p.item.topic, "answer": said, "em": exact_match(said, p.item.gold),
                                   "f1": token_f1(said, p.item.gold), "prompt_tokens": len(tokens), "s": seconds})
            if i % 10 == 0 or i == len(prompts):
                log(f"  {i}/{len(prompts)} questions ({time.perf_counter() - t0:.0f} s)")
        placement.update({k: v for k, v in engine.stats().items() if k.startswith("placement_")})

    log(f"{cfg.label}: {len(prompts)} questions x {len(opts.modes)} modes, "
        + ("placed chunks kept in the KV tiers, nothing else reused" if placing else "prefix cache off"))
    try:
        await serving(engine, scenario)
    finally:
        shutil.rmtree(data, ignore_errors=True)
    summary = []
    for mode in opts.modes:
        base = baseline(mode, opts.modes)
        f1 = [r["f1"] for r in rows[mode]]
        row = {"mode": mode, "questions": len(f1), "em": mean([r["em"] for r in rows[mode]]), "f1": mean(f1),
               "prompt_tokens": mean([r["prompt_tokens"] for r in rows[mode]])}
        if mode != base:
            d, lo, hi = paired_interval([r["f1"] for r in rows[base]], f1, seed)
            row.update({"f1_vs": base, "f1_diff": d, "f1_diff_lo": lo, "f1_diff_hi": hi,
                        "same_answer": mean([float(a["answer"] == b["answer"]) for a, b in zip(rows[base], rows[mode])])})
        summary.append(row)
    return {"engine": cfg.label, "summary": summary, "rows": rows, "placement": placement,
            "gold": [{"topic": p.item.topic, "question": p.item.question, "gold": p.item.gold} for p in prompts]}


def baseline(mode: str, modes: list[str]) -> str:
    """The mode ``mode`` is compared with: its family's question-first layout where it was run, else the first."""
    own = "leaf-question-first" if mode.startswith(LEAF) else "question-first"
    pieces = dict(zip(PLACED_MODES, PIECES_MODES)).get(mode)
    if pieces in modes:  # the placement's own effect: the same tokens, prefilled whole
        own = pieces
    return own if own in modes else modes[0]


def text_report(results: dict[str, Any]) -> str:
    from headrace.bench.quality_report import cpu_line

    meta = results["meta"]
    lines = [f"# headrace bench rag-qa, {meta['time'].replace('T', ' ')}", "",
             f"CPU: {cpu_line(meta['cpu'])}; other processes used {meta['cpu_cores'].get('other_processes', 0):.2f} "
             "cores on average meanwhile.", f"Command: `{meta['command']}`", "",
             f"Engine: {results['engine']}, "
             + ("placed chunks from the KV tiers, nothing else reused" if results.get("placement") else "prefix cache off")
             + f"; {results['summary'][0]['questions']} questions, "
             "3 chunks each (naive_rag's one-shot synthesis; a leaf mode: the answer's chunk alone, as a tree leaf), "
             "greedy, the answer's first line scored.", "",
             "| mode | EM | token F1 | F1 vs its baseline (95% CI) | same answer | prompt tokens |",
             "|---|---|---|---|---|---|"]
    for r in results["summary"]:
        vs = (f"{100 * r['f1_diff']:+.1f} ({100 * r['f1_diff_lo']:+.1f} to {100 * r['f1_diff_hi']:+.1f}) "
              f"vs {r['f1_vs']}"
              if "f1_diff" in r else "-")
        same = f"{r['same_answer']:.0%}" if "same_answer" in r else "-"
        lines.append(f"| {r['mode']} | {100 * r['em']:.1f} | {100 * r['f1']:.1f} | {vs} | {same} | "
                     f"{r['prompt_tokens']:.0f} |")
    return "\n".join(lines)


def run_command(args: Any) -> int:
    import anyio

    from headrace.bench.cpu import CPUWatch
    from headrace.bench.quality_report import describe_cpu
    from headrace.bench.subcommand import machine
    from headrace.daemon.config import load_config

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    others = [w for w in args.workloads if w != RAG_QA]
    if others or args.url:
        print(f"headrace bench: {RAG_QA} runs alone, its engine in this process: drop "
              f"{' '.join(others) or '--url'}", file=sys.stderr)
        return 2
    opts = QAOptions(list(args.qa_modes), args.qa_questions, args.qa_tokens, args.qa_recompute, args.qa_select,
                     args.qa_select_ratio, args.qa_select_layer)
    try:
        opts.check()
    except ValueError as exc:
        print(f"headrace bench: {exc}", file=sys.stderr)
        return 2
    cpu = CPUWatch()
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    t0 = time.perf_counter()
    results = anyio.run(qa_phase, args.config, load_config(args.config).data.cache_path(), opts, args.seed,
                        lambda line: print(line, flush=True))
    placing = opts.placing
    command = (f"headrace bench {RAG_QA} --config {args.config} --qa-modes {' '.join(opts.modes)} --qa-tokens {opts.tokens}"
               + (f" --qa-questions {opts.questions}" if opts.questions else "")
               + (f" --qa-recompute {opts.recompute}" if placing else "")
               + (f" --qa-select {opts.select} --qa-select-ratio {opts.select_ratio}"
                  f" --qa-select-layer {opts.select_layer}"
                  if placing and opts.select != "first" else "")
               + (f" --seed {args.seed}" if args.seed else "") + f" --out {args.out}")
    results["meta"] = {"machine": machine(), "cpu": describe_cpu(), "cpu_cores": cpu.cores(), "time": started,
                       "elapsed_s": time.perf_counter() - t0, "command": command}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    text = text_report(results)
    (out / "results.md").write_text(text + "\n")
    print(text)
    return 0


__all__ = ["RAG_QA", "MODES", "QAOptions", "add_arguments", "qa_prompts", "render", "qa_phase", "run_command"]
