"""The ``agents`` benchmark's workload: client-side tool-calling agents through the openai SDK.

An agent here runs as LangChain's and the OpenAI Agents SDK's do: the client holds the loop.
Each turn is one ``/v1/chat/completions`` request carrying the whole conversation so far and
the tool schemas; the client runs the tool the model called (here it sleeps the tool's time),
appends the call and a ``tool`` message with its result, and asks again. Every agent is a
program: it sends ``prompt_cache_key`` = its id, so the daemon knows its turns belong together.

What the daemon sees per agent (the ``full`` size): a shared system prompt of about 1,000 tokens
(instructions, reference text and the tool schemas, which SmolLM2's template renders into the
system message), the agent's own task, then per turn a forced tool call (about 35 tokens with its
tags) and a 20-token result, so with the chat template's role headers the context grows by about
80 tokens a turn, to about 1,950 at the longest agents' last turn (the default engine holds 2,048).
Turns per agent are heavy-tailed over 2-12 (P(n) ~ n^-1.5: most agents are short, a few long),
tool times log-uniform over 0.2-3 s. Every turn but the last names its tool in ``tool_choice``,
so the output is constrained to that call and a 135M model cannot end the loop early; the last
turn adds a user message asking for a one-sentence answer (``tool_choice: auto``, so the
rendered tools, and with them the cached prefix, stay the same). Everything is drawn from the
seed, so every mode serves the same agents.

The ``responses`` mode runs the same agents as OpenAI's Responses API has them: each turn is one
``POST /v1/responses`` continuing the last (``previous_response_id``) with only what is new (the
task, then each tool's result as a ``function_call_output`` item; the forced tool in ``tool_choice``
as on chat). The server rebuilds the conversation, so the prompts are the chat mode's token for token,
and the chain is the program: no ``prompt_cache_key`` is sent.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Literal

import anyio

from headrace.bench.baselines import require
from headrace.bench.corpus import Corpus

AGENTS = "agents"  # the benchmark's name on the ``headrace bench`` command line
TAIL = 1.5  # turns per agent: P(n) proportional to n ** -TAIL over the shape's range

# Modes: the LLM engine's settings (a PATCH /v1/engines/{engine} body) while the mode's agents run.
# llm_policy and prefix_caching go through the harness's own switches (restored at the end); any other
# key is patched as given and put back after the mode (room for retention and eviction settings).
AGENT_MODES: dict[str, dict[str, Any]] = {
    # vLLM's semantics: FCFS, LRU prefix cache
    "per-request": {"llm_policy": "fifo", "prefix_caching": True, "retention": False},
    # program-level least attained service (Autellix) alone
    "las": {"llm_policy": "las", "prefix_caching": True, "retention": False},
    # a program's context pinned across its tool calls, evicted by predicted next use (Continuum, KVFlow) alone
    "retention": {"llm_policy": "fifo", "prefix_caching": True, "retention": True},
    "program-aware": {"llm_policy": "las", "prefix_caching": True, "retention": True},  # both levers
    "no-prefix-cache": {"llm_policy": "fifo", "prefix_caching": False, "retention": False},  # every turn prefilled whole
}
# Not a PATCH of this daemon: a second daemon, started from .venv-vllm on the ``vllm`` engine plugin
# (plugins-contrib/headrace-vllm) with vLLM's own automatic prefix caching and ``fifo`` (``agents_vllm``).
VLLM_MODE = "vllm"
# Not settings either: the agents drive POST /v1/responses (``AgentClient.run_responses``) under the settings of
# RESPONSES_SETTINGS, so that against that mode only the protocol differs.
RESPONSES_MODE = "responses"
RESPONSES_SETTINGS = "program-aware"
DEFAULT_AGENT_MODES = ("per-request", "program-aware")
BASE_MODE = "per-request"  # the capacity probe runs in it, and the ratios are against it


@dataclass(frozen=True)
class AgentShape:
    """The sizes of one benchmark run (``--agents-size``)."""

    name: str
    system_tokens: int  # the shared system prompt, tool schemas included
    turns: tuple[int, int]  # fewest and most turns per agent
    tool_s: tuple[float, float]  # a tool's time, log-uniform in this range
    result_tokens: int  # one tool result
    call_tokens: int  # max_tokens of a forced tool call (it ends at its closing tag)
    answer_tokens: int  # max_tokens of the last turn's answer
    probe_agents: int  # agents at once in the closed-loop capacity probe
    probe_programs: int  # agents the probe runs in all
    background_tokens: int = 500  # a background chat's prompt, about (``agents_chats``)
    chat_tokens: int = 150  # a probe chat's prompt, about
    chat_output: int = 8  # max_tokens of a background or probe chat


SHAPES = {
    "full": AgentShape("full", 1000, (2, 12), (0.2, 3.0), 20, 64, 24, probe_agents=8, probe_programs=24),
    # The smallest that still exercises everything: a short prompt, two or three turns, quick tools.
    "smoke": AgentShape("smoke", 200, (2, 3), (0.05, 0.2), 12, 64, 8, probe_agents=2, probe_programs=3,
                        background_tokens=100, chat_tokens=60, chat_output=4),
}

# Arguments are enums, so a forced call is short and bounded whatever the model writes.
_ORDERS = ["A1042", "A2210", "B0317", "B5561", "C7788", "C9034"]
_TOPICS = ["refunds", "shipping", "warranty", "accounts", "billing", "returns"]
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "lookup_order", "description": "Look up an order: its status, items and shipping address.",
        "parameters": {"type": "object", "properties": {"order_id": {"type": "string", "enum": _ORDERS}},
                       "required": ["order_id"]}}},
    {"type": "function", "function": {
        "name": "search_docs", "description": "Search the product documentation for a topic.",
        "parameters": {"type": "object", "properties": {"topic": {"type": "string", "enum": _TOPICS}},
                       "required": ["topic"]}}},
    {"type": "function", "function": {
        "name": "check_stock", "description": "How many units of an item the warehouse holds.",
        "parameters": {"type": "object", "properties": {"sku": {"type": "integer", "minimum": 1, "maximum": 999}},
                       "required": ["sku"]}}},
    {"type": "function", "function": {
        "name": "escalate", "description": "Hand the ticket to a human, with a priority.",
        "parameters": {"type": "object", "properties": {"priority": {"type": "string",
                                                                     "enum": ["low", "normal", "high"]}},
                       "required": ["priority"]}}},
]
INSTRUCTIONS = ("You are the support agent of a software shop. Work through the customer's ticket with the tools: "
                "call one tool at a time and read its result before the next. When told to answer, reply to the "
                "customer in one short sentence.")
ANSWER_NOW = "Answer the customer now, in one short sentence."
# The same tools in the Responses API's flat shape.
RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
Api = Literal["chat", "responses"]


@dataclass(frozen=True)
class Program:
    """One agent, the same in every mode: its task, the tool each turn but the last calls, and each tool's time
    and result."""

    index: int
    task: str
    tools: tuple[str, ...]  # one per turn but the last
    tool_s: tuple[float, ...]
    results: tuple[str, ...]

    @property
    def turns(self) -> int:
        return len(self.tools) + 1


def turn_weights(shape: AgentShape) -> dict[int, float]:
    lo, hi = shape.turns
    weights = {n: n ** -TAIL for n in range(lo, hi + 1)}
    total = sum(weights.values())
    return {n: w / total for n, w in weights.items()}


def mean_turns(shape: AgentShape) -> float:
    return sum(n * p for n, p in turn_weights(shape).items())


def draw_programs(n: int, shape: AgentShape, corpus: Corpus, snippets: list[str], seed: int) -> list[Program]:
    """``n`` agents drawn from ``seed``: turns heavy-tailed, tools and their times and results at random."""
    rng = random.Random(seed)
    weights = turn_weights(shape)
    lo, hi = shape.tool_s
    out = []
    for i in range(n):
        turns = rng.choices(list(weights), weights=list(weights.values()))[0]
        question = corpus.questions[i % len(corpus.questions)].text
        calls = tuple(rng.choice(TOOLS)["function"]["name"] for _ in range(turns - 1))
        times = tuple(round(math.exp(rng.uniform(math.log(lo), math.log(hi))), 3) for _ in calls)
        results = tuple(f"[{i}.{t}] {rng.choice(snippets)}" for t in range(len(calls)))
        out.append(Program(i, f"Ticket {i}: {question} Look it up with the tools before you answer.",
                           calls, times, results))
    return out


@dataclass
class Turn:
    index: int
    latency_s: float  # request sent to the whole response read (a tool call arrives whole)
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    answered_s: float = 0.0  # when its answer was read (time.perf_counter): the live working set's clock
    # usage.prompt_tokens_details.cached_tokens (Responses: usage.input_tokens_details.cached_tokens): prefix-cache
    # hits, as the engine says
    cached_tokens: int = 0


@dataclass
class AgentRecord:
    """What one agent's run came to (turns answered so far, even if it failed or was cancelled)."""

    program: int
    planned_turns: int
    turns: list[Turn] = field(default_factory=list)
    sent: int = 0  # requests sent (a turn whose request failed is sent, not answered)
    tool_s: float = 0.0  # time spent in its tools
    job_s: float | None = None  # first request sent to the last answer read; None: did not finish
    started_s: float | None = None  # its first request sent (time.perf_counter)


class AgentError(RuntimeError):
    """A forced turn came back without its tool call."""


class AgentClient:
    """The agents' openai SDK client against one daemon (one connection pool for every agent)."""

    def __init__(self, base_url: str, api_key: str, model: str, shape: AgentShape, system: str) -> None:
        openai = require("openai", "openai", "the agents benchmark")
        self.client = openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key or "unused",
                                         max_retries=0, timeout=900.0)
        self.model, self.shape, self.system = model, shape, system

    async def aclose(self) -> None:
        await self.client.close()

    async def warm_up(self, task: str, system: str | None = None) -> None:
        """One forced call of every tool, at once and unmeasured: each named tool compiles its own grammar the first
        time it is asked for. ``system``: another system prompt, so the warm-up leaves nothing of the agents' own
        prompt in a prefix cache that cannot be emptied afterwards (vLLM's)."""
        messages = [{"role": "system", "content": system or self.system}, {"role": "user", "content": task}]
        async with anyio.create_task_group() as tg:
            for tool in TOOLS:
                choice = {"type": "function", "function": {"name": tool["function"]["name"]}}
                tg.start_soon(lambda c=choice: self.client.chat.completions.create(
                    model=self.model, messages=messages, tools=TOOLS, tool_choice=c, temperature=0,
                    max_tokens=self.shape.call_tokens))

    async def run(self, program: Program, key: str, record: AgentRecord, tools_wait: bool = True,
                  on_turn: Callable[[], None] | None = None, api: Api = "chat") -> AgentRecord:
        """Run ``program`` as agent ``key`` (its ``prompt_cache_key``), filling ``record`` turn by turn; with
        ``tools_wait`` false the tools return at once (the capacity probe). ``api``: chat completions, or the
        Responses API (``run_responses``)."""
        if api == "responses":
            return await self.run_responses(program, key, record, tools_wait, on_turn)
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.system},
                                          {"role": "user", "content": program.task}]
        t0 = record.started_s = time.perf_counter()
        for t in range(program.turns):
            last = t == program.turns - 1
            if last:
                messages.append({"role": "user", "content": ANSWER_NOW})
                choice: Any = "auto"
            else:
                choice = {"type": "function", "function": {"name": program.tools[t]}}
            sent = time.perf_counter()
            record.sent += 1
            response = await self.client.chat.completions.create(
                model=self.model, messages=messages, tools=TOOLS, tool_choice=choice, temperature=0,
                max_tokens=self.shape.answer_tokens if last else self.shape.call_tokens, prompt_cache_key=key)
            usage, reply, now = response.usage, response.choices[0], time.perf_counter()
            details = usage.prompt_tokens_details if usage else None
            record.turns.append(Turn(t, now - sent, usage.prompt_tokens if usage else 0,
                                     usage.completion_tokens if usage else 0, reply.finish_reason, now,
                                     (details.cached_tokens or 0) if details is not None else 0))
            if on_turn is not None:
                on_turn()
            if last:
                break
            calls = reply.message.tool_calls or []
            if not calls:
                raise AgentError(f"agent {key} turn {t}: tool_choice named {program.tools[t]} but the reply has no "
                                 f"call (finish_reason {reply.finish_reason})")
            call = calls[0]
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": call.function.arguments}}]})
            if tools_wait:
                await anyio.sleep(program.tool_s[t])
                record.tool_s += program.tool_s[t]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": program.results[t]})
        record.job_s = time.perf_counter() - t0
        return record

    async def run_responses(self, program: Program, key: str, record: AgentRecord, tools_wait: bool = True,
                            on_turn: Callable[[], None] | None = None) -> AgentRecord:
        """``run`` through ``POST /v1/responses``: each turn continues the last by ``previous_response_id`` and sends
        only the new items. The instructions and tools go with every turn (the API carries neither over); ``key``
        names the agent in errors only (the chain is its program)."""
        items: list[dict[str, Any]] = [{"role": "user", "content": program.task}]
        previous: dict[str, Any] = {}
        t0 = record.started_s = time.perf_counter()
        for t in range(program.turns):
            last = t == program.turns - 1
            if last:
                items.append({"role": "user", "content": ANSWER_NOW})
                choice: Any = "auto"
            else:
                choice = {"type": "function", "name": program.tools[t]}
            sent = time.perf_counter()
            record.sent += 1
            response = await self.client.responses.create(
                model=self.model, instructions=self.system, input=items, tools=RESPONSES_TOOLS, tool_choice=choice,
                temperature=0, max_output_tokens=self.shape.answer_tokens if last else self.shape.call_tokens,
                **previous)
            usage, now = response.usage, time.perf_counter()
            calls = [item for item in response.output if item.type == "function_call"]
            finish = "length" if response.status == "incomplete" else "tool_calls" if calls else "stop"
            details = usage.input_tokens_details if usage else None
            record.turns.append(Turn(t, now - sent, usage.input_tokens if usage else 0,
                                     usage.output_tokens if usage else 0, finish, now,
                                     (details.cached_tokens or 0) if details is not None else 0))
            if on_turn is not None:
                on_turn()
            if last:
                break
            if not calls:
                raise AgentError(f"agent {key} turn {t}: tool_choice named {program.tools[t]} but the response has "
                                 f"no function_call (status {response.status})")
            previous = {"previous_response_id": response.id}
            if tools_wait:
                await anyio.sleep(program.tool_s[t])
                record.tool_s += program.tool_s[t]
            items = [{"type": "function_call_output", "call_id": calls[0].call_id, "output": program.results[t]}]
        record.job_s = time.perf_counter() - t0
        return record


Tokenize = Callable[[str], Awaitable[list[int]]]
Detokenize = Callable[[list[int]], Awaitable[str]]


async def build_prompts(corpus: Corpus, shape: AgentShape, tokenize: Tokenize, detokenize: Detokenize,
                        n_snippets: int = 48, seed: int = 0) -> tuple[str, list[str], dict[str, int]]:
    """The shared system prompt (instructions and reference text, about ``shape.system_tokens`` with the tool
    schemas) and a pool of tool results of ``shape.result_tokens`` each, cut from the corpus in the daemon's
    own tokens; and their measured sizes."""
    from headrace.plugins.engines.llm.chat import tools_system_prompt  # the text the tools render as (SmolLM2)

    text = "\n".join(d.text for d in corpus.documents)
    tokens = await tokenize(text)
    fixed = len(await tokenize(INSTRUCTIONS + "\n\nReference:\n\n\n" + tools_system_prompt(TOOLS)))
    room = max(0, min(shape.system_tokens - fixed, len(tokens)))
    system = INSTRUCTIONS + ("\n\nReference:\n" + await detokenize(tokens[:room]) if room else "")
    rng = random.Random(seed)
    span = shape.result_tokens
    snippets = []
    for _ in range(n_snippets):
        start = rng.randrange(room, max(room + 1, len(tokens) - span))  # never the system prompt's own text
        snippets.append(" ".join((await detokenize(tokens[start:start + span])).split()))
    sizes = {"system_tokens": len(await tokenize(system + "\n\n" + tools_system_prompt(TOOLS))),
             "result_tokens": span, "corpus_tokens": len(tokens)}
    return system, snippets, sizes


@dataclass
class AgentsOptions:
    """The agents benchmark's settings (``headrace bench agents --agents-...``)."""

    shape: AgentShape = SHAPES["full"]
    fractions: list[float] = field(default_factory=list)  # of the measured capacity
    rates: list[float] = field(default_factory=list)  # programs per second, as given
    programs: int = 60  # Poisson arrivals per point
    modes: list[str] = field(default_factory=lambda: list(DEFAULT_AGENT_MODES))
    probe_agents: int | None = None  # None: the shape's
    drain_s: float = 300.0  # after the last arrival, how long stragglers may finish
    seed: int = 0
    background: float = 0.0  # unrelated chats per second beside the agents (``agents_chats``); 0: none
    background_tokens: int | None = None  # their prompts, about; None: the shape's
    chats: float = 0.0  # probe chats per second beside the agents, their TTFT set against an idle engine's; 0: none
    idle_chats: int = 5  # probe chats, one at a time, on the idle engine before each point
    # A memory-pressure point: the LLM's prefix cache budget in tokens for the whole phase (None: the daemon's
    # own), and its pins' (None: the configured share of it).
    cache_tokens: int | None = None
    pin_tokens: int | None = None
    # The ``vllm`` mode's venv (None: $HEADRACE_VLLM_VENV, else the repository's .venv-vllm) and its daemon's config
    # (None: configs/vllm-cpu.toml); checked before anything is measured (``agents_vllm.check_vllm``).
    vllm_venv: Path | None = None
    vllm_config: Path | None = None
    # Or a vLLM daemon already running (``headrace serve`` on the vllm engine plugin), used as it is: nothing is
    # started or closed, and its prefix cache holds whatever it served before.
    vllm_url: str | None = None
    vllm_api_key: str = ""

    def check(self) -> None:
        known = [*AGENT_MODES, RESPONSES_MODE, VLLM_MODE]
        unknown = [m for m in self.modes if m not in known]
        if unknown:
            raise ValueError(f"unknown agents mode(s) {unknown}; choose from {', '.join(known)}")
        if self.programs < 1 or any(f <= 0 for f in self.fractions) or any(r <= 0 for r in self.rates):
            raise ValueError("--agents-programs, --agents-fractions and --agents-rates must be > 0")
        if self.probe_agents is not None and self.probe_agents < 1:
            raise ValueError("--agents-probe must be >= 1")
        if self.background < 0 or self.chats < 0:
            raise ValueError("--agents-background and --agents-chats must be >= 0")
        if self.background_tokens is not None and self.background_tokens < 1:
            raise ValueError("--agents-background-tokens must be >= 1")
        if self.cache_tokens is not None and self.cache_tokens < 1:
            raise ValueError("--agents-cache-tokens must be >= 1")
        if self.pin_tokens is not None and (self.cache_tokens is None or not 0 <= self.pin_tokens <= self.cache_tokens):
            raise ValueError("--agents-pin-tokens needs --agents-cache-tokens, and from 0 to it")
        if self.vllm_url is not None:
            if not self.vllm_url.startswith(("http://", "https://")):
                raise ValueError(f"--agents-vllm-url must be an http(s) URL, not {self.vllm_url!r}")
            if self.vllm_venv is not None or self.vllm_config is not None:
                raise ValueError("--agents-vllm-url uses a running daemon: --agents-vllm-venv and "
                                 "--agents-vllm-config start one; give either, not both")

    @property
    def budget(self) -> tuple[int, int | None] | None:
        """The prefix cache's (tokens, pin tokens) every mode runs with; None: the daemon's own."""
        return None if self.cache_tokens is None else (self.cache_tokens, self.pin_tokens)
