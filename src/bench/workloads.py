"""Workloads and modes: what the harness runs, and the systems it runs it on.

A workload is one built-in workflow with its inputs drawn from the corpus. A
mode is a way to run it against the daemon under test:

- ``headrace``: the workflow server-side, every pass on, topology-aware batching,
  under the LLM policy the daemon is configured with;
- ``headrace-<policy>``: the same under one LLM policy (``fifo``, ``topology``,
  ``objective``, ``deadline``, ``las``), set on the daemon's LLM before the mode runs;
- ``sequential``: server-side, no pass, FIFO batching: the module chain inside
  the daemon (the internal baseline);
- ``+<pass>``: the ablation ladder from ``sequential``, switching each pass on in
  turn (``+topology`` last would equal ``headrace``);
- ``llamaindex`` (RAG) / ``chaining`` (summaries): the peer baselines as clients;
- ``client`` (debate, agent): the traced workflow's loop written as an openai-SDK client
  (DyOrc's client-side baseline);
- ``semantic`` (summaries): the same work submitted by a client as Parrot's semantic
  calls (one session; the daemon chains the calls), under the daemon's own LLM policy.

The baselines, ``sequential`` and the ladder run under the ``fifo`` LLM policy,
as a plain server serves requests.

Every workflow setting stays at the graph issue's defaults (chunk size, top-k,
expanded queries, synthesis mode) except the output length, which is shortened
so a full harness run fits in minutes on a 2-core CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from headrace.bench.corpus import Corpus

PASSES = ("prune_dependencies", "stage_decomposition", "prefill_split", "decode_pipelining")
HEADRACE = "headrace"
SEQUENTIAL = "sequential"
SEMANTIC = "semantic"
LLM_POLICIES = ("fifo", "topology", "objective", "deadline", "las")


@dataclass(frozen=True)
class Workload:
    name: str
    workflow: str
    baseline: str | None  # the peer baseline's mode, if the workflow has one
    config: dict[str, Any] = field(default_factory=dict)  # shortened outputs; everything else default
    client_modes: tuple[str, ...] = ()  # other client-side modes it runs in (semantic calls)
    slo_factor: float = 3.0  # SLO = factor x the baseline's single-query latency
    # Queries over a corpus indexed once (a persistent collection; LlamaIndex: one index kept across
    # queries) instead of each run indexing the document it is handed.
    collection: bool = False

    def inputs(self, corpus: Corpus, i: int) -> dict[str, Any]:
        """The i-th request's inputs (questions cycle; each comes with its own document, or asks the collection)."""
        q = corpus.questions[i % len(corpus.questions)]
        if self.collection:
            return {"question": q.text, "collection": BENCH_COLLECTION}
        doc = corpus.documents[q.document].text
        if self.workflow in ("map_reduce_summary", "chain_summary"):
            return {"document": doc}
        if self.workflow in ("debate", "agent"):  # no documents: the agent then calculates or answers
            return {"question": q.text}
        return {"question": q.text, "documents": [doc]}


WORKLOADS = {
    w.name: w for w in (
        Workload("naive_rag", "naive_rag", "llamaindex", {"max_tokens": 24}),
        Workload("advanced_rag", "advanced_rag", "llamaindex", {"max_tokens": 24}),
        Workload("naive_rag_collection", "naive_rag", "llamaindex", {"max_tokens": 24}, collection=True),
        Workload("advanced_rag_collection", "advanced_rag", "llamaindex", {"max_tokens": 24}, collection=True),
        Workload("map_reduce_summary", "map_reduce_summary", "chaining", {"max_tokens": 24}, (SEMANTIC,)),
        Workload("chain_summary", "chain_summary", "chaining", {"max_tokens": 24}, (SEMANTIC,)),
        Workload("fact_verify", "fact_verify", None, {"max_tokens": 24}),
        Workload("debate", "debate", "client", {"agents": 2, "rounds": 2, "max_tokens": 24}),
        Workload("agent", "agent", "client", {"max_steps": 3, "max_tokens": 24}),
    )
}
MIXED = ("advanced_rag", "map_reduce_summary")  # Ayo §7.2: two workflows co-located, sharing the LLM
MIXED_MODES = (f"{HEADRACE}-topology",)  # the headrace modes a mixed load runs against its baselines, by default
BENCH_COLLECTION = "bench_corpus"  # the persistent collection the *_collection workloads query


def server_modes() -> dict[str, dict[str, Any]]:
    """Server-side modes -> the run config they add: sequential, the cumulative ladder, headrace."""
    modes: dict[str, dict[str, Any]] = {SEQUENTIAL: {"optimize": {"passes": []}, "batch_policy": "fifo"}}
    on: list[str] = []
    for p in PASSES:
        on.append(p)
        modes[f"+{p}"] = {"optimize": {"passes": list(on)}, "batch_policy": "fifo"}
    modes[HEADRACE] = {"optimize": {"passes": list(PASSES)}, "batch_policy": "topology"}
    for policy in LLM_POLICIES:
        modes[f"{HEADRACE}-{policy}"] = dict(modes[HEADRACE])
    return modes


def split_mode(mode: str) -> tuple[str, int | None]:
    """``headrace-deadline@4`` -> (``headrace-deadline``, 4): a server-side mode with the LLM serving at most
    4 runs at once (``max_runs``); a mode without ``@`` keeps the daemon's configured bound (None)."""
    base, at, runs = mode.partition("@")
    if not at:
        return mode, None
    if not runs.isdigit() or not is_headrace(base):
        raise ValueError(f"mode {mode!r}: '@N' takes a headrace mode and a whole number of runs (0: no bound)")
    return base, int(runs)


def llm_policy_of(mode: str) -> str | None:
    """The LLM policy a mode runs under; None: whatever the daemon is configured with."""
    mode = mode.partition("@")[0]
    if mode.startswith(f"{HEADRACE}-"):
        return mode.removeprefix(f"{HEADRACE}-")
    return None if mode in (HEADRACE, SEMANTIC) else "fifo"


def max_runs_of(mode: str) -> int | None:
    """The LLM's bound on runs at once in a mode; None: the daemon's configured one (baselines: always)."""
    return split_mode(mode)[1]


def is_headrace(mode: str) -> bool:
    mode = mode.partition("@")[0]
    return mode == HEADRACE or mode.startswith(f"{HEADRACE}-")


def default_modes(workload: Workload, ladder: bool) -> list[str]:
    """The baseline, sequential and headrace; with ``ladder``, every pass switched on in turn too."""
    modes = ([workload.baseline] if workload.baseline else []) + list(workload.client_modes)
    ladder_modes = [m for m in server_modes() if m == SEQUENTIAL or m.startswith("+") or m == HEADRACE]
    return modes + (ladder_modes if ladder else [SEQUENTIAL, HEADRACE])
