"""``rag-repeat``'s peer mode and its client-side retrieval.

The peer a user would assemble from llama.cpp: ``llama-server -np 16 --cache-ram 8192 --cache-reuse 256`` (its
host-RAM prompt cache, and chunks reused away from the prefix by shifting their positions) serving the LLM
calls, the pipeline driven from the client. Of the harness's client-driven baselines this is the chaining one
(``baselines/chaining.py``: each call one request carrying exactly the text headrace renders, the next prompt
built from the answers), not the LlamaIndex one: LlamaIndex's tree synthesis words its combine calls its own
way and its refine skips empty answers, so its greedy answers would differ from headrace's for reasons that
are not the cache's, and its client costs CPU on the cores the servers share. Here every prompt is headrace's
own template rendered with ``PromptTemplate`` and tokenized by the helper daemon's chat template
(``POST /tokenize``), and those token ids are the prompt llama-server gets: both servers see the same tokens.

Retrieval is the LlamaIndex baseline's way (client-side cosine search over the daemon's embeddings of the same
chunks, ``chunk_text`` at the workflows' defaults); embeddings and tokenizing come from a helper headrace daemon
started from the same config with its tiers off, which runs no LLM call of the pipeline itself. advanced_rag's
rerank is headrace's ``llm-rerank`` judge asked of llama-server (``PeerJudge``): the same chat per candidate
(document first, cut to the same token budgets), one token's top logprobs each, scored by the logit margin of
"yes" over "no" as the engine scores it. So every LLM call of the peer's pipeline is llama-server's, through its
caches, and no second LLM shares its cores (the helper's judge did, until 2026-12-02: two processes' ggml
threads on two cores, under which the peer fell behind at any rate measured). llama-server's binary is
``scripts/build-llama-server``'s and it is started by ``scripts/bench/peers.py`` (the GGUF, threads, slots and
CPU variant it gives llama-server), with the two cache flags added. Its calls are streamed with
``timings_per_token``: tokens prefilled are its ``timings.prompt_n`` (prompt tokens not taken from its cache).

The same retrieval measures the workload's popularity for the report (``popularity``): the share of the
question searches' retrievals (naive_rag's top_k) that the top 3% of chunks drew.
"""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np

from headrace.bench.baselines import client_validate
from headrace.bench.client import BenchError, Daemon
from headrace.graph.ops import chunk_text
from headrace.graph.parsers import LineParser
from headrace.graph.prompts import PromptTemplate
from headrace.graph.workflows import common, rag
from headrace.plugins.engines.retrieval.rerankers import (MAX_DOC_TOKENS, MAX_QUERY_TOKENS, NO_VARIANTS, YES_VARIANTS,
                                                          judge_messages, truncation)

CACHE_FLAGS = ["--cache-ram", "8192", "--cache-reuse", "256"]
WORKFLOWS = {"naive_rag": rag.NAIVE, "advanced_rag": rag.ADVANCED}
EMBED_BATCH = 32
REPO = Path(__file__).resolve().parents[2]
READY_S = 600


class Retriever:
    """The collection's chunks and their embeddings, searched by cosine on the client."""

    def __init__(self, chunks: list[str], matrix: np.ndarray, embedder: str) -> None:
        self.chunks, self.matrix, self.embedder = chunks, matrix, embedder

    @classmethod
    async def build(cls, daemon: Daemon, documents: list[str], chunk_size: int, chunk_overlap: int) -> "Retriever":
        kinds = await daemon.models()
        embedder = next((m for m, k in kinds.items() if k == "embed"), None)
        if embedder is None:
            raise BenchError("the daemon serves no embedder")
        chunks = chunk_text(documents, chunk_size, chunk_overlap)
        return cls(chunks, await embed(daemon, embedder, chunks), embedder)

    async def search(self, daemon: Daemon, texts: list[str], k: int) -> list[list[int]]:
        """Each text's ``k`` nearest chunks (indices), nearest first."""
        scores = await embed(daemon, self.embedder, texts) @ self.matrix.T
        return [list(np.argsort(-row, kind="stable")[:k]) for row in scores]


async def embed(daemon: Daemon, model: str, texts: list[str]) -> np.ndarray:
    rows = []
    for i in range(0, len(texts), EMBED_BATCH):
        body = await daemon._json("POST", "/v1/embeddings", json={"model": model, "input": texts[i:i + EMBED_BATCH]})
        rows += [d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])]
    matrix = np.asarray(rows, dtype=np.float32)
    return matrix / np.maximum(np.linalg.norm(matrix, axis=1, keepdims=True), 1e-12)


async def popularity(bench: Any, daemon: Daemon) -> dict[str, Any]:
    """How concentrated the workload's retrievals are; builds ``bench.retriever`` (the peer's) once."""
    from headrace.bench.rag_repeat_workload import CHUNK_OVERLAP, CHUNK_SIZE, TOP_SHARE

    bench.retriever = await Retriever.build(daemon, [d.text for d in bench.plan.corpus.documents], CHUNK_SIZE,
                                            CHUNK_OVERLAP)
    queries = [q.text for point in bench.plan.points for q in point]
    k = rag.NAIVE.config["top_k"]["default"]
    found = await bench.retriever.search(daemon, queries, k)
    counts = Counter(i for row in found for i in row)
    top = max(1, math.ceil(TOP_SHARE * len(bench.retriever.chunks)))
    drawn = sum(n for _, n in counts.most_common(top))
    return {"queries": len(queries), "top_k": k, "chunks": len(bench.retriever.chunks), "top_chunks": top,
            "top_share": drawn / max(1, len(queries) * k), "chunks_retrieved": len(counts),
            "distinct_questions": len(set(queries))}


class PeerPipeline:
    """naive_rag and advanced_rag driven from the client: the LLM calls to llama-server, the rest to the helper."""

    def __init__(self, helper: Daemon, retriever: Retriever, server: httpx.AsyncClient, body_extra: dict[str, Any],
                 llm: str) -> None:
        self.helper, self.retriever, self.server, self.extra = helper, retriever, server, body_extra
        self.llm = llm
        self.judge = PeerJudge(self)

    async def run(self, workflow: str, question: str, config: dict[str, Any], record: Any) -> None:
        inputs, config = client_validate("the llama-server peer", WORKFLOWS, workflow, {"question": question},
                                         config)
        t0 = time.perf_counter()
        if workflow == "naive_rag":
            (found,) = await self.retriever.search(self.helper, [question], config["top_k"])
            contexts = self._texts(found, config["top_k"])
            answer = await self._tree(question, contexts, config, record, t0)
        else:
            contexts = await self._advanced_contexts(question, config, record, t0)
            answer = await self._refine(question, contexts, config, record, t0)
        record.latency_s = time.perf_counter() - t0
        record.answer = answer
        if record.ttft_s is None:
            record.ttft_s = record.latency_s

    def _texts(self, indices: list[int], n: int) -> list[str]:
        texts = [self.retriever.chunks[i] for i in indices]
        return (texts + [""] * n)[:n]  # headrace pads missing contexts with empty strings

    async def _tree(self, question: str, contexts: list[str], config: dict[str, Any], record: Any,
                    t0: float) -> str:
        """``common.synthesize``'s tree: a leaf per context, then fan-in 3 per level; one_shot for one context."""
        answer_t, _, one_shot_t = common.STEPS[config["context_first"]]
        n, max_tokens = len(contexts), config["max_tokens"]
        if n <= 1:
            text = PromptTemplate(one_shot_t.prompt).render({"question": question, "contexts": contexts})
            return await self.call(text, max_tokens, record, t0, final=True)
        level = await self._gather([PromptTemplate(answer_t.prompt).render({"question": question, "context": c})
                                    for c in contexts], max_tokens, record, t0, final=False)
        while len(level) > 1:
            groups = [level[i:i + 3] for i in range(0, len(level), 3)]
            prompts = [PromptTemplate(common.COMBINE_HEAD + "".join(f"Answer {j + 1}: {{{{input:a{j}}}}}\n"
                                                                    for j in range(len(g)))
                                      + "Combined answer: {{output:answer}}").render(
                {"question": question, **{f"a{j}": a for j, a in enumerate(g)}}) for g in groups]
            level = await self._gather(prompts, max_tokens, record, t0, final=len(groups) == 1)
        return level[0]

    async def _refine(self, question: str, contexts: list[str], config: dict[str, Any], record: Any,
                      t0: float) -> str:
        answer_t, refine_t, _ = common.STEPS[config["context_first"]]
        max_tokens, n = config["max_tokens"], len(contexts)
        text = await self.call(PromptTemplate(answer_t.prompt).render({"question": question, "context": contexts[0]}),
                               max_tokens, record, t0, final=n == 1)
        for i in range(1, n):
            text = await self.call(PromptTemplate(refine_t.prompt).render(
                {"question": question, "previous": text, "context": contexts[i]}), max_tokens, record, t0,
                final=i == n - 1)
        return text

    async def _advanced_contexts(self, question: str, config: dict[str, Any], record: Any, t0: float) -> list[str]:
        """Expansion (stopped after n_queries lines, as headrace's), multi-query search, merge, rerank."""
        n, k = config["n_queries"], config["k_per_query"]
        expansion = PromptTemplate(rag.EXPAND).render({"n_queries": str(n), "question": question})
        queries = await self.call(expansion, 16 * n, record, t0, final=False, lines=n)
        found = await self.retriever.search(self.helper, [*queries, question], k)
        contexts = [self.retriever.chunks[i] for i in found[-1]]
        candidates = [self.retriever.chunks[i] for row in found[:-1] for i in row]
        pool = list(dict.fromkeys([*contexts, *candidates]))
        top = await self.judge.top(question, pool, config["top_n"], record)
        return (top + [""] * config["top_n"])[:config["top_n"]]

    async def _gather(self, prompts: list[str], max_tokens: int, record: Any, t0: float, final: bool) -> list[str]:
        out = [""] * len(prompts)

        async def one(i: int) -> None:
            out[i] = await self.call(prompts[i], max_tokens, record, t0, final=final)

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        return out

    async def tokens(self, text: str | None = None, messages: list[dict[str, str]] | None = None) -> list[int]:
        """The helper's tokenizer: a chat (headrace's chat template, the assistant turn opened) or a bare text."""
        body = ({"messages": messages, "add_generation_prompt": True} if messages is not None
                else {"prompt": text, "add_special_tokens": False})
        return (await self.helper._json("POST", "/tokenize", json={"model": self.llm, **body}))["tokens"]

    async def call(self, text: str, max_tokens: int, record: Any, t0: float, final: bool,
                   lines: int | None = None) -> Any:
        """One LLM call: the prompt as headrace's chat template tokenizes it, streamed from the server's
        ``/v1/completions`` (llama-server's; any OpenAI-compatible one). The answer stripped (or, with ``lines``,
        the first that many parsed lines, the stream closed after them). Tokens prefilled: the server's
        ``timings.prompt_n`` where it sends timings, else the whole prompt."""
        tokens = await self.tokens(messages=[{"role": "user", "content": text}])
        body = {"model": self.llm, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                **self.extra}
        parts, timings = [], None
        parser, pieces = (LineParser(), []) if lines else (None, [])
        async with self.server.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise BenchError(f"llama-server: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    raise BenchError(f"llama-server: {chunk['error']}")
                timings = chunk.get("timings") or timings
                piece = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
                if piece and final and record.ttft_s is None:
                    record.ttft_s = time.perf_counter() - t0
                parts.append(piece)
                if parser is not None:
                    pieces += parser.feed(piece)
                    if len(pieces) >= lines:
                        break
        record.prompt_tokens += len(tokens)
        record.prefilled_tokens += int(timings["prompt_n"]) if timings and "prompt_n" in timings else len(tokens)
        if parser is not None:
            return (pieces + parser.finish())[:lines] if len(pieces) < lines else pieces[:lines]
        return "".join(parts).strip()


class PeerJudge:
    """``llm-rerank``'s judge asked of the peer's server: each candidate's chat (document first, as the helper's
    config and headrace's default have it) prompted with ``max_tokens`` 1 and ``logprobs`` 20, scored
    logsumexp(yes variants) - logsumexp(no variants) over the variants among the top 20 (a side with none there is
    put at the 20th's logprob, a bound). The engine takes the same margin over every variant's logit; the top 20 of
    a 49k vocabulary hold the judge's answers. Reads llama-server's logprobs (``content[0].top_logprobs``) and the
    OpenAI completions' (``top_logprobs[0]``, headrace's)."""

    TOP = 20

    def __init__(self, pipeline: PeerPipeline) -> None:
        self.pipeline = pipeline

    async def top(self, query: str, documents: list[str], top_n: int, record: Any) -> list[str]:
        query = await self.cut(query, MAX_QUERY_TOKENS)
        scores = [0.0] * len(documents)

        async def one(i: int) -> None:
            doc = await self.cut(documents[i], MAX_DOC_TOKENS)
            scores[i] = await self.score(judge_messages(query, doc, True), record)

        async with anyio.create_task_group() as tg:
            for i in range(len(documents)):
                tg.start_soon(one, i)
        order = sorted(range(len(documents)), key=lambda i: -scores[i])  # stable: ties keep the pool's order
        return [documents[i] for i in order[:top_n]]

    async def cut(self, text: str, max_tokens: int) -> str:
        steps = truncation(text, max_tokens)
        probe = next(steps)
        try:
            while True:
                probe = steps.send(len(await self.pipeline.tokens(probe)))
        except StopIteration as done:
            return done.value

    async def score(self, messages: list[dict[str, str]], record: Any) -> float:
        pipeline = self.pipeline
        tokens = await pipeline.tokens(messages=messages)
        body = {**pipeline.extra, "model": pipeline.llm, "prompt": tokens, "max_tokens": 1, "temperature": 0,
                "logprobs": self.TOP, "stream": False}
        response = await pipeline.server.post("/v1/completions", json=body)
        if response.status_code != 200:
            raise BenchError(f"the judge's call: HTTP {response.status_code}: {response.text[:300]!r}")
        out = response.json()
        timings = out.get("timings") or {}
        record.prompt_tokens += len(tokens)
        record.prefilled_tokens += int(timings["prompt_n"]) if "prompt_n" in timings else len(tokens)
        return judge_margin(out["choices"][0]["logprobs"])


def judge_margin(logprobs: dict[str, Any]) -> float:
    """log P(yes) - log P(no) from one token's top logprobs, in llama-server's shape or OpenAI completions'."""
    if "content" in logprobs:
        top = {t["token"]: t["logprob"] for t in logprobs["content"][0]["top_logprobs"]}
    else:
        top = logprobs["top_logprobs"][0]
    floor = min(top.values())

    def pooled(words: tuple[str, ...]) -> float:
        found = [top[w] for w in words if w in top]
        return float(np.logaddexp.reduce(found)) if found else floor

    return pooled(YES_VARIANTS) - pooled(NO_VARIANTS)


def llama_server_built() -> str | None:
    """Why the peer cannot run here, or None: its binary is built once by scripts/build-llama-server."""
    script = REPO / "scripts" / "build-llama-server"
    if not script.exists():
        return f"{script} is absent (the peer mode needs a source checkout)"
    if subprocess.run([str(script), "--cached"], capture_output=True, cwd=REPO).returncode != 0:
        return "llama-server is not built: run scripts/build-llama-server first (about 20 CPU-minutes, once)"
    return None


def peers_script() -> Any:
    """scripts/bench/peers.py, which knows how to start llama-server (its GGUF, threads, slots, CPU variant)."""
    where = str(REPO / "scripts" / "bench")
    if where not in sys.path:
        sys.path.insert(0, where)
    return importlib.import_module("peers")


async def peer_mode(bench: Any, workflow: str) -> dict[str, Any]:
    """The workflow against llama-server, with a helper daemon for embeddings and tokenizing."""
    from headrace.bench.rag_repeat import PEER, Target, workflow_config

    missing = llama_server_built()
    if missing:
        bench.log(f"  {workflow}, {PEER}: skipped: {missing}")
        return {"skipped": missing}
    peers = peers_script()
    try:
        pair = peers.llama_server_pair()
    except SystemExit as exc:
        raise BenchError(f"llama-server: {exc}") from None
    spec = pair.peer
    spec.argv = [*spec.argv, *CACHE_FLAGS]
    bench.log(f"  {workflow}, {PEER}: starting the helper daemon and llama-server")
    async with bench.daemon_for(PEER, workflow) as helper:
        if bench.retrieval is None:
            bench.retrieval = await popularity(bench, helper)
        kinds = await helper.models()
        llm = next(m for m, k in kinds.items() if k == "llm")
        run_dir = bench.work / f"{PEER}-{workflow}-server"
        run_dir.mkdir()
        try:
            with peers.running(spec, run_dir, READY_S) as (base, _, argv):
                # A new connection per request, as peers.py measures it: llama-server closes kept-alive ones.
                limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
                async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(None, connect=10),
                                             limits=limits) as server:
                    # Its prompt cache on (its default, said), and its timings on every streamed chunk.
                    extra = {**spec.body_extra, "cache_prompt": True, "timings_per_token": True}
                    pipeline = PeerPipeline(helper, bench.retriever, server, extra, llm)
                    out = await bench.measure(PEER, workflow, Target(helper, workflow,
                                                                     workflow_config(PEER, bench.opts), pipeline),
                                              None)
        except SystemExit as exc:  # peers.py says why a server failed that way
            raise BenchError(f"llama-server: {exc}") from None
    return {**out, "argv": argv, "settings": pair.settings}


__all__ = ["PeerJudge", "PeerPipeline", "judge_margin", "Retriever", "peer_mode", "popularity", "llama_server_built"]
