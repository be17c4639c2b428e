"""What one iteration of the llama.cpp core puts through ``llama_decode``: the planner.

An iteration's batch is a token for every decoding row, then chunks of queued prefills and of
prefill-only scoring prompts (the LLM reranker's), within the token budget, in the policy's order.
Scoring jobs live in a :class:`ScoringQueue` on scratch sequences of their own: a run of prompts that
share a prefix (the reranker's system prompt and query) prefills it once into a scratch sequence,
which each prompt's sequence then copies. The core (``llama_cpp``) owns the llama.cpp objects, the
contexts and the KV bookkeeping; this module only decides what goes in, and in what order.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from headrace.plugins.engines.kvreuse.prefix_cache import common_prefix
from headrace.plugins.engines.llm.core import Row
from headrace.plugins.engines.llm.messages import Logits, Outbox, Prefill
from headrace.plugins.engines.llm.prompt_scores import PromptScorer
from headrace.types import TokenIds

# Scoring prompts that start with at least this many equal tokens (the reranker's system prompt
# and query) prefill them once and fork them: below it a fork saves less than it costs.
MIN_SHARED_SCORING_PREFIX = 16


@dataclass
class Fill:
    """Tokens on their way into a sequence, a chunk per iteration: a prefill, or one prompt to score."""

    seq: int
    tokens: TokenIds
    start: int  # position of tokens[0]
    done: int = 0  # tokens already decoded
    prefill: Prefill | None = None
    cached: int = 0  # a prefill's tokens found in the prefix cache (not in ``tokens``): its reply says so
    job: ScoreJob | None = None
    index: int = 0  # the prompt's row in the scoring job
    group: SharedPrefix | None = None  # set on a scoring group's shared-prefix fill
    scorer: PromptScorer | None = None  # a teacher-forced prefill: logits at every position go to it

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.done


@dataclass
class SharedPrefix:
    """Scoring prompts ``start`` to ``end`` (exclusive) begin with the same ``length`` tokens: those
    are prefilled once into a scratch sequence, which each prompt's own sequence forks."""

    start: int
    end: int
    length: int
    seq: int | None = None  # the prefix's scratch sequence while it is held
    ready: bool = False  # its prefill is done: prompts may fork it


@dataclass
class ScoreJob:
    cmd: Logits
    result: torch.Tensor  # (prompts, token_ids)
    groups: list[SharedPrefix]  # runs of prompts sharing a prefix (length 0: nothing shared)
    started: int = 0  # prompts given a scratch sequence so far
    finished: int = 0
    fills: list[Fill] = field(default_factory=list)  # in flight


@dataclass
class Part:
    """One piece of an iteration's batch, and the tokens it put in: what fails alone if it fails."""

    kind: str  # "decode", "prefill" or "score"
    rows: list[Row] = field(default_factory=list)
    fill: Fill | None = None
    count: int = 0  # tokens of this part in the batch

    @property
    def ends_fill(self) -> bool:
        return self.fill is not None and self.fill.done + self.count == len(self.fill.tokens)

    @property
    def outputs(self) -> int:
        """Logits rows it asks for: one per decoding row, one where a prompt ends (not a shared prefix), every
        token's for a teacher-forced prefill."""
        if self.kind == "decode":
            return len(self.rows)
        if self.fill.scorer is not None:
            return self.count
        return int(self.ends_fill and self.fill.group is None)


def shared_prefix_groups(prompts: list[TokenIds], minimum: int) -> list[SharedPrefix]:
    """Consecutive prompts grouped by a common prefix, each group's as long as pays best.

    A prompt joins the group when the tokens saved with it (members x shared length) are no fewer
    than without it, so one query's documents share the system prompt and the query, and the next
    query's documents start a group of their own. A prefix always leaves a prompt its last token,
    whose logits are the score.
    """
    groups: list[SharedPrefix] = []
    i = 0
    while i < len(prompts):
        shared, j = len(prompts[i]) - 1, i + 1
        while j < len(prompts):
            common = min(common_length(prompts[i], prompts[j], shared), len(prompts[j]) - 1)
            members = j - i + 1
            if common < minimum or (members > 2 and members * common < (members - 1) * shared):
                break
            shared, j = common, j + 1
        groups.append(SharedPrefix(i, j, shared if j - i > 1 else 0))
        i = j
    return groups


def common_length(a: TokenIds, b: TokenIds, limit: int) -> int:
    return common_prefix(a[:limit], b[:limit])


class ScoringQueue:
    """Scoring jobs in flight, most urgent first, each prompt on a scratch sequence of its own.

    ``copy(src, dst)`` makes ``dst`` a copy of ``src``'s KV; ``clear(seq)`` empties a sequence. In a
    unified KV (``cell_limit``: half its cells) scoring may not crowd out the contexts; with a stream
    per sequence each scratch sequence has its own cells, so there is no limit but the sequences.
    """

    def __init__(self, copy: Callable[[int, int], None], clear: Callable[[int], None],
                 cell_limit: int | None) -> None:
        self._copy = copy
        self._clear = clear
        self._cell_limit = cell_limit
        self.jobs: deque[ScoreJob] = deque()
        self.free: list[int] = []  # scratch sequences not in use (a stack: low ids first)

    def __bool__(self) -> bool:
        return bool(self.jobs)

    def add(self, cmd: Logits) -> None:
        result = torch.empty(len(cmd.prompts), len(cmd.token_ids), dtype=torch.float32)
        groups = shared_prefix_groups([list(p) for p in cmd.prompts], MIN_SHARED_SCORING_PREFIX)
        self.jobs.append(ScoreJob(cmd, result, groups))

    def prune_and_sort(self) -> None:
        """The policy's order: lowest priority first (stable, so oldest first among equals); abandoned jobs go."""
        for job in [j for j in self.jobs if j.cmd.reply.abandoned]:
            self.end(job)
        self.jobs = deque(sorted(self.jobs, key=lambda j: j.cmd.priority))

    def end(self, job: ScoreJob) -> None:
        """Give back the job's scratch sequences and forget it."""
        for fill in job.fills:
            if fill.group is None:  # a prefix's sequence is its group's, dropped below
                self._drop(fill.seq)
        for group in job.groups:
            self._drop_prefix(group)
        job.fills.clear()
        self.jobs.remove(job)

    def _drop(self, seq: int) -> None:
        self._clear(seq)
        self.free.append(seq)

    def _drop_prefix(self, group: SharedPrefix) -> None:
        if group.seq is not None:
            self._drop(group.seq)
            group.seq = None

    def fills(self) -> Iterator[Fill]:
        """Scoring prompts in flight, oldest job first, starting new ones while scratch sequences are free.

        A group's shared prefix is prefilled first; its prompts fork it from the next iteration on
        and fill only their own suffixes.
        """
        in_flight = sum(len(f.tokens) for j in self.jobs for f in j.fills)
        room = True
        for job in list(self.jobs):
            yield from list(job.fills)
            while room and job.started < len(job.cmd.prompts) and self.free:
                i = job.started
                prompt = job.cmd.prompts[i]
                group = next(g for g in job.groups if g.start <= i < g.end)
                shared = group.length
                if shared and not group.ready:
                    if group.seq is None:  # start the prefix; its prompts wait for it
                        group.seq = self.free.pop()
                        fill = Fill(seq=group.seq, tokens=prompt[:shared], start=0, job=job, group=group)
                        in_flight += shared
                        job.fills.append(fill)
                        yield fill
                    break
                n = len(prompt) - shared
                if self._cell_limit is not None and in_flight and in_flight + n > self._cell_limit:
                    room = False  # one prompt always may
                    break
                in_flight += n
                seq = self.free.pop()
                if shared:
                    self._copy(group.seq, seq)
                fill = Fill(seq=seq, tokens=prompt[shared:], start=shared, job=job, index=i)
                job.started += 1
                if job.started == group.end:  # every prompt of the group has forked its prefix
                    self._drop_prefix(group)
                job.fills.append(fill)
                yield fill

    def filled(self, fill: Fill, logits: torch.Tensor, out: Outbox) -> None:
        """A scoring fill's chunk went in: a finished prefix lets its prompts fork it; a finished prompt's
        scores are kept, and the job answers once every prompt has its own."""
        if fill.remaining:
            return
        job = fill.job
        job.fills.remove(fill)
        if fill.group is not None:
            fill.group.ready = True
            return
        job.result[fill.index] = logits[0, job.cmd.token_ids]
        self._drop(fill.seq)
        job.finished += 1
        if job.finished == len(job.cmd.prompts):
            self.jobs.remove(job)
            out.reply(job.cmd.reply, job.result)

    def fail_all(self, error: BaseException, out: Outbox) -> None:
        for job in list(self.jobs):
            out.reply(job.cmd.reply, error=error)
            self.end(job)


def plan(rows: list[Row], prefills: deque[Fill], scoring: ScoringQueue, budget: int) -> list[Part]:
    """This iteration's batch: a token per decoding row, then prefill and scoring chunks in the budget.

    ``prefills`` and ``scoring`` are in the policy's order already. With both waiting at the same
    urgency, prefills take at most half the budget, so neither starves.
    """
    parts: list[Part] = []
    if rows:
        parts.append(Part("decode", rows=list(rows), count=len(rows)))
    if not prefills and not scoring:  # the steady decode
        return parts
    budget -= len(rows)
    scoring_first = bool(scoring) and (not prefills or scoring.jobs[0].cmd.priority < prefills[0].prefill.priority)
    prefill_budget = budget // 2 if scoring and not scoring_first else budget
    used = 0

    def take_prefills(limit: int) -> None:
        nonlocal used
        for fill in prefills:
            if used >= limit:
                break
            n = min(fill.remaining, limit - used)
            parts.append(Part("prefill", fill=fill, count=n))
            used += n

    if not scoring_first:
        take_prefills(prefill_budget)
    for fill in scoring.fills():
        if used >= budget:
            break
        n = min(fill.remaining, budget - used)
        parts.append(Part("score", fill=fill, count=n))
        used += n
    if scoring_first:
        take_prefills(budget)
    return parts


@dataclass
class BatchEntry:
    seq: int
    token: int
    pos: int
    logits: bool  # wants its logits row


def batch_entries(parts: list[Part], seq_of: Callable[[Row], int]) -> tuple[list[BatchEntry], list[int]]:
    """The parts' tokens in the order llama_decode gets them, and for each logits row it returns (in that
    order) the row's place in part order.

    By sequence id (stable: a sequence's tokens stay in order): with a stream per sequence llama.cpp
    splits a batch into ubatches of consecutive sequence ids with equal token counts, so sorting makes
    as few as it can.
    """
    entries: list[BatchEntry] = []  # part order
    for part in parts:
        if part.kind == "decode":
            entries += [BatchEntry(seq_of(r), r.pending, r.length, True) for r in part.rows]
        else:
            fill, last = part.fill, part.count - 1
            entries += [BatchEntry(fill.seq, fill.tokens[fill.done + k], fill.start + fill.done + k,
                                   fill.scorer is not None or (bool(part.outputs) and k == last))
                        for k in range(part.count)]
    order = sorted(range(len(entries)), key=lambda k: entries[k].seq)
    rank = list(itertools.accumulate(e.logits for e in entries))  # rank[k] - 1: entry k's logits row, part order
    return [entries[k] for k in order], [rank[k] - 1 for k in order if entries[k].logits]


def write_batch(batch: Any, entries: list[BatchEntry]) -> None:
    """Fill a ``llama_batch`` (made by ``llama_batch_init`` for at least this many tokens) with the entries."""
    for i, e in enumerate(entries):
        batch.token[i] = e.token
        batch.pos[i] = e.pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = e.seq
        batch.logits[i] = e.logits
    batch.n_tokens = len(entries)


class DecodeFailed(RuntimeError):
    """``llama_decode`` returned an error code for a batch."""

    MEANINGS = {1: "no room in the KV cache (raise the engine's n_ctx option)", 2: "aborted",
                -1: "invalid input batch"}

    def __init__(self, rc: int) -> None:
        super().__init__(f"llama_decode returned {rc}: {self.MEANINGS.get(rc, 'fatal error')}")
        self.rc = rc
