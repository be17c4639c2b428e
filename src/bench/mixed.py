"""The ``mixed`` benchmark's workload: one arrival stream of programs of five kinds and very different sizes.

Issue 28's second benchmark: where every arrival is the same workflow every order is about the same
order, so the programs here differ. One seeded Poisson stream carries, in the ``full`` size's shares:

- ``chat`` (40%): one streamed ``/v1/chat/completions`` call on a shared system prompt, no
  ``prompt_cache_key`` (a program of one call); its answer's length heavy-tailed over 16-256 tokens;
- ``naive_rag`` (25%): the built-in workflow over one corpus document, run server-side;
- ``map_reduce_summary`` (15%): the built-in workflow over one corpus document;
- ``agent`` (10%): the traced ReAct workflow over the corpus indexed once as a collection, its
  ``max_steps`` heavy-tailed over 2-8 (the model may answer sooner);
- ``client_agent`` (10%): the agents benchmark's client-side tool-calling agent (``agents.py``,
  its ``full`` sizes: 2-12 turns, tools 0.2-3 s) through the openai SDK.

So most programs are one or a few LLM calls and a few are long, as in the traces Autellix and
Continuum measured. The kinds' counts per point are their shares of ``programs`` exactly (largest
remainder), their order shuffled from the seed; everything a program does is drawn from the seed,
so every mode serves the same programs on the same arrival times. A workflow run uses the
workload's shortened output length (``workloads.WORKLOADS``) and the daemon's defaults otherwise.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

from headrace.bench.agents import SHAPES as AGENT_SHAPES
from headrace.bench.agents import AgentClient, AgentRecord, AgentShape, draw_programs
from headrace.bench.agents import Program as AgentProgram
from headrace.bench.corpus import Corpus
from headrace.bench.workloads import BENCH_COLLECTION, WORKLOADS

MIXED_BENCH = "mixed"  # the benchmark's name on the ``headrace bench`` command line
KINDS = ("chat", "naive_rag", "map_reduce_summary", "agent", "client_agent")
WORKFLOW_KINDS = ("naive_rag", "map_reduce_summary", "agent")  # runs of the built-in workflows


@dataclass(frozen=True)
class MixShape:
    """The sizes of one ``mixed`` run (``--mixed-size``)."""

    name: str
    shares: dict[str, float]  # kind -> its share of the arrivals
    chat_tokens: tuple[int, ...]  # a chat answer's max_tokens: one of these, each half as likely as the one before
    agent_steps: tuple[int, int]  # a traced agent's max_steps, P(n) ~ n^-1.5 over this range
    agents: AgentShape  # the client agents' sizes
    probe_programs: int  # programs the closed-loop capacity probe runs in all
    probe_concurrency: int  # programs at once in it
    workflow_tokens: int | None = None  # max_tokens of a workflow program's LLM calls; None: its workload's own


SHAPES = {
    "full": MixShape("full", {"chat": 0.4, "naive_rag": 0.25, "map_reduce_summary": 0.15, "agent": 0.1,
                              "client_agent": 0.1},
                     (16, 32, 64, 128, 256), (2, 8), AGENT_SHAPES["full"], probe_programs=30, probe_concurrency=8),
    # One program of each kind in five arrivals, each as small as it goes: the smoke test's size.
    "smoke": MixShape("smoke", {kind: 0.2 for kind in KINDS}, (4, 8), (1, 2), AGENT_SHAPES["smoke"],
                      probe_programs=5, probe_concurrency=2, workflow_tokens=4),
}
TAIL = 1.5


@dataclass(frozen=True)
class MixProgram:
    """One arrival of the stream: its kind and everything it will do, the same in every mode."""

    index: int
    kind: str
    question: int  # the corpus question (and with it the document) it is about
    max_tokens: int | None = None  # a chat's answer length
    max_steps: int | None = None  # a traced agent's step bound
    agent: AgentProgram | None = None  # a client agent's turns, tools and results

    def size(self) -> int:
        """LLM calls it makes at most (a workflow's are its own; counted as one here, a traced agent's as its steps)."""
        if self.agent is not None:
            return self.agent.turns
        return self.max_steps + 1 if self.max_steps is not None else 1


def quotas(shares: dict[str, float], n: int) -> dict[str, int]:
    """``n`` split over the kinds in proportion to their shares (largest remainder), so every point and mode has
    exactly the same mix."""
    total = sum(shares.values())
    exact = {k: n * s / total for k, s in shares.items()}
    out = {k: math.floor(x) for k, x in exact.items()}
    for k in sorted(exact, key=lambda k: (out[k] - exact[k], KINDS.index(k)))[:n - sum(out.values())]:
        out[k] += 1
    return out


def draw_mix(n: int, shape: MixShape, corpus: Corpus, snippets: list[str], seed: int) -> list[MixProgram]:
    """``n`` programs drawn from ``seed``: the kinds in their shares, shuffled; each one's size at random."""
    rng = random.Random(seed)
    kinds = [k for k, count in quotas(shape.shares, n).items() for _ in range(count)]
    rng.shuffle(kinds)
    agents = iter(draw_programs(kinds.count("client_agent"), shape.agents, corpus, snippets, seed))
    lo, hi = shape.agent_steps
    steps = list(range(lo, hi + 1))
    out = []
    for i, kind in enumerate(kinds):
        question = rng.randrange(len(corpus.questions))
        if kind == "chat":
            tokens = rng.choices(shape.chat_tokens, weights=[2.0 ** -j for j in range(len(shape.chat_tokens))])[0]
            out.append(MixProgram(i, kind, question, max_tokens=tokens))
        elif kind == "agent":
            out.append(MixProgram(i, kind, question, max_steps=rng.choices(steps, [s ** -TAIL for s in steps])[0]))
        elif kind == "client_agent":
            out.append(MixProgram(i, kind, question, agent=next(agents)))
        else:
            out.append(MixProgram(i, kind, question))
    return out


@dataclass
class ProgramRecord:
    """What one program came to in one mode."""

    index: int
    kind: str
    latency_s: float | None = None  # arrival (its first request sent) to its last answer read; None: not finished
    turns: list[float] = field(default_factory=list)  # a client agent's turn latencies
    error: str | None = None


class MixRunner:
    """Runs one program of any kind against the daemon."""

    def __init__(self, daemon: Any, llm: str, corpus: Corpus, system: str, agents: AgentClient,
                 workflow_tokens: int | None = None) -> None:
        self.daemon, self.llm, self.corpus, self.system, self.agents = daemon, llm, corpus, system, agents
        self.workflow_tokens = workflow_tokens

    async def run(self, program: MixProgram, key: str, record: ProgramRecord, tools_wait: bool = True) -> None:
        t0 = time.perf_counter()
        q = self.corpus.questions[program.question]
        if program.kind == "chat":
            messages = [{"role": "system", "content": self.system},
                        {"role": "user", "content": f"({program.index}) {q.text}"}]
            await self.daemon.chat_stream(self.llm, messages, program.max_tokens)
        elif program.kind == "client_agent":
            agent = AgentRecord(program.index, program.agent.turns)
            try:
                await self.agents.run(program.agent, key, agent, tools_wait=tools_wait)
            finally:
                record.turns = [t.latency_s for t in agent.turns]
        else:
            workload = WORKLOADS[program.kind]
            config = dict(workload.config)
            if self.workflow_tokens is not None:
                config["max_tokens"] = self.workflow_tokens
            if program.kind == "agent":
                inputs = {"question": q.text, "collection": BENCH_COLLECTION}
                config["max_steps"] = program.max_steps
            else:
                inputs = workload.inputs(self.corpus, program.question)
            await self.daemon.run(workload.workflow, inputs, config)
        record.latency_s = time.perf_counter() - t0


@dataclass
class MixedOptions:
    """The mixed benchmark's settings (``headrace bench mixed --mixed-...``)."""

    shape: MixShape = SHAPES["full"]
    fractions: list[float] = field(default_factory=list)  # of the measured capacity
    rates: list[float] = field(default_factory=list)  # programs per second, as given
    programs: int = 60  # Poisson arrivals per point
    modes: list[str] = field(default_factory=lambda: ["per-request", "program-aware"])
    probe_concurrency: int | None = None  # None: the shape's
    drain_s: float = 300.0  # after the last arrival, how long stragglers may finish
    seed: int = 0

    def check(self) -> None:
        from headrace.bench.agents import AGENT_MODES

        unknown = [m for m in self.modes if m not in AGENT_MODES]
        if unknown:
            raise ValueError(f"unknown mixed mode(s) {unknown}; choose from {', '.join(AGENT_MODES)} (the "
                             "--mixed-rate load's modes are --mixed-rate-modes)")
        if self.programs < 1 or any(f <= 0 for f in self.fractions) or any(r <= 0 for r in self.rates):
            raise ValueError("--mixed-programs, --mixed-fractions and --mixed-rates must be > 0")
        if self.probe_concurrency is not None and self.probe_concurrency < 1:
            raise ValueError("--mixed-probe must be >= 1")
