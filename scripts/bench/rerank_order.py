"""The LLM reranker's prompt order (issue 49): what putting the document first costs in ranking, and what scoring it
through the prefix cache saves.

``llm-rerank`` asks the LLM "is this document relevant to this query?" per candidate. Query first (the default) the
candidates of one query share the system prompt and the query, and every document is computed again for every
query. Document first (``document_first``) every prompt starts with its document, and the LLM scores it through its
prefix cache and KV tiers (``ScoresThroughCache``), so a document scored once is restored, not computed, the next time
any query retrieves it.

Questions: ``quality.qa``'s extractive questions over standard-library docstrings ("What does module.name return?").
Documents: the bench corpus chunked as the workflows chunk it (256 words, 30 shared); a question's gold chunk is the
one holding its answer span and its function's name. Each question's pool is its gold chunk and ``--pool - 1``
others drawn (seeded) from ``--distractors`` chunks, so documents recur across questions as popular chunks do.

- ranking: per order, the gold chunk's rank in each pool: hit@1, hit@3 (advanced_rag keeps 3) and MRR, and the
  questions where the two orders disagree on hit@3;
- short documents: nine one-sentence toy questions of three candidates each (``SHORT``), right answers ranked
  first per order;
- time: seconds a question (its pool scored in one call, on an idle engine) query first, document first on the
  first pass (documents cached as they recur), and document first again with the question reworded ("Which value
  is returned by module.name?"): every document then cached, the warm bound; with the share of document-first
  prompt tokens found cached.

One llama-cpp engine (the default model and weights, its default options, host tier 4 GiB, no disk tier) serves
both orders; the query-first pass runs first (it caches nothing).

Usage: .venv/bin/python scripts/bench/rerank_order.py --questions 60 --out rerank.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import anyio

from headrace.bench.corpus import MODULES, _sections
from headrace.graph.ops import chunk_text
from headrace.plugins.engines.llama_cpp.engine import LlamaCppLLM
from headrace.plugins.engines.llama_cpp.files import default_cache_dir
from headrace.plugins.engines.retrieval.rerankers import LLMReranker
from headrace.plugins.protocols import EngineEnv, EngineSpec
from headrace.quality.qa import returns_items

from benchlib import cpu_name  # beside this script

CHUNK_SIZE, CHUNK_OVERLAP = 256, 30  # the workflows' chunking
# Short documents: one sentence each, three candidates, one of them the answer (a question, its candidates, the
# answer's index): what a /v1/rerank client's toy check sends.
SHORT_SETS = [  # three candidates, then a question answered by each in turn
    (("Bananas are a yellow fruit.", "Paris is the capital and largest city of France.",
      "The stock market fell on Monday."),
     ("Which fruit is yellow?", "What is the capital of France?", "What happened to the stock market?")),
    (("Spiders have eight legs.", "The moon orbits the Earth.", "Water boils at 100 degrees Celsius."),
     ("How many legs does a spider have?", "What orbits the Earth?", "When does water boil?")),
    (("Shakespeare wrote Hamlet around 1600.", "Python is a programming language.", "The Nile is a river in Africa."),
     ("Who wrote Hamlet?", "What is Python?", "Which river is in Africa?")),
]
SHORT = [(question, docs, gold) for docs, questions in SHORT_SETS for gold, question in enumerate(questions)]
IDLE_S = 1.0  # each clock starts on an idle engine (a freed context's deferred cache copy lands outside it)


def corpus(seed: int) -> tuple[list[tuple[str, str, str]], list[str]]:
    """(question, reworded question, gold chunk) per usable question, and every chunk."""
    chunks, items = [], []
    for module in MODULES + ("posixpath", "ipaddress", "platform", "traceback", "codecs", "os", "re", "ast"):
        sections = _sections(module)
        chunks += chunk_text("\n\n".join(s for _, s in sections), CHUNK_SIZE, CHUNK_OVERLAP)
        items += returns_items(sections)
    usable = []
    for item in items:
        span = " ".join(item.gold.split())
        holding = [c for c in chunks if span in c and f"{item.topic}:" in c]
        if len(holding) == 1:
            reworded = item.question.replace("What does ", "Which value is returned by ").replace(" return?", "?")
            usable.append((item.question, reworded, holding[0]))
    random.Random(seed).shuffle(usable)
    return usable, chunks


def ranks(scores, gold: int) -> int:
    """The gold document's rank (1 = first), ties counted against it."""
    return 1 + sum(1 for i, s in enumerate(scores) if i != gold and s >= scores[gold])


def summary(rank_list: list[int]) -> dict:
    n = len(rank_list)
    return {"hit@1": sum(r == 1 for r in rank_list) / n, "hit@3": sum(r <= 3 for r in rank_list) / n,
            "mrr": statistics.fmean(1 / r for r in rank_list)}


async def measure(engine, args) -> dict:
    usable, chunks = await anyio.to_thread.run_sync(corpus, args.seed)
    questions = usable[: args.questions]
    rng = random.Random(args.seed + 1)
    golds = {gold for _, _, gold in usable}
    distractors = rng.sample([c for c in chunks if c not in golds], args.distractors)
    pools = []
    for _, _, gold in questions:
        docs = rng.sample([d for d in distractors if gold not in d], args.pool - 1)
        at = rng.randrange(args.pool)
        docs.insert(at, gold)
        pools.append((docs, at))
    env = EngineEnv(data_dir=Path(args.data), cache_dir=default_cache_dir(), lookup=lambda name: engine)
    judges = {order: LLMReranker(EngineSpec(name=f"judge-{order}", plugin="llm-rerank",
                                            options={"llm": "smollm2", "document_first": order == "document-first"}),
                                 env)
              for order in ("query-first", "document-first")}
    out: dict = {"questions": len(questions), "pool": args.pool, "distractors": args.distractors}
    async with anyio.create_task_group() as tg:
        for judge in judges.values():
            await tg.start(judge.run)
        passes = [("query-first", 0), ("document-first", 0), ("document-first", 1)]
        for order, wording in passes:
            judge = judges[order]
            rank_list, times = [], []
            before = engine.stats()
            for q, ((question, reworded, _), (docs, at)) in enumerate(zip(questions, pools)):
                await anyio.sleep(IDLE_S)
                t0 = time.perf_counter()
                scores = (await judge.score(reworded if wording else question, docs)).tolist()
                times.append(time.perf_counter() - t0)
                rank_list.append(ranks(scores, at))
                print(f"  {order}{' reworded' if wording else ''} {q + 1}/{len(questions)}: {times[-1]:.2f} s, "
                      f"gold rank {rank_list[-1]}", flush=True)
            after = engine.stats()
            key = order + (" reworded" if wording else "")
            out[key] = {**summary(rank_list), "ranks": rank_list, "s_per_question": statistics.fmean(times),
                        "times": times, "stats_delta": {k: after[k] - before.get(k, 0) for k in after
                                                        if isinstance(after[k], (int, float))}}
        for order, judge in judges.items():
            out[f"short {order}"] = sum([ranks((await judge.score(q, list(docs))).tolist(), gold) == 1
                                         for q, docs, gold in SHORT])
        tg.cancel_scope.cancel()
    out["short"] = len(SHORT)
    a, b = out["query-first"]["ranks"], out["document-first"]["ranks"]
    out["hit@3_disagree"] = sum((x <= 3) != (y <= 3) for x, y in zip(a, b))
    return out




def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--questions", type=int, default=60)
    p.add_argument("--pool", type=int, default=16, help="candidates a question (advanced_rag merges 16)")
    p.add_argument("--distractors", type=int, default=48)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    spec = EngineSpec(name="smollm2", plugin="llama-cpp",
                      options={"threads": args.threads, "kv_host_mib": 4096, "kv_disk_mib": 0})
    with tempfile.TemporaryDirectory() as data:
        args.data = data
        env = EngineEnv(data_dir=Path(data), cache_dir=default_cache_dir(), lookup=lambda name: None)
        engine = LlamaCppLLM(spec, env)

        async def run() -> dict:
            async with anyio.create_task_group() as tg:
                await tg.start(engine.run)
                try:
                    return await measure(engine, args)
                finally:
                    tg.cancel_scope.cancel()

        result = anyio.run(run)
    result["cpu"] = cpu_name()
    result["command"] = "scripts/bench/rerank_order.py " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items() if k not in ("out", "data") and v is not None)
    for key in ("query-first", "document-first", "document-first reworded"):
        r = result[key]
        print(f"{key:>24}: hit@1 {r['hit@1']:.3f}  hit@3 {r['hit@3']:.3f}  MRR {r['mrr']:.3f}  "
              f"{r['s_per_question']:.2f} s a question")
    print(f"hit@3 differs on {result['hit@3_disagree']} of {result['questions']} questions")
    print(f"short documents (one sentence, 3 candidates): query first {result['short query-first']} of "
          f"{result['short']} right, document first {result['short document-first']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
