"""The KV paths a prompt's context can come by, each scored teacher-forced on an answer: engine-neutral.

Every path fills a context with the prompt by its own route, then scores ``answer`` against that context
(``ScoresPrompts.prompt_logprobs(answer, parent=ctx, full=True)``: row ``j`` is the distribution ``answer[j]`` was
drawn from), and optionally lets the engine decode its own greedy continuation from the same context (prefill then
decode: what ``generate`` does). The rows compared with a reference's say what the path does to the numbers.

- ``cold``: the prompt prefilled with nothing reused (an engine whose prefix cache is off, or that holds nothing
  of it: a reuse is refused as ``PathNotTaken``);
- ``fork``: the prompt's natural head prefilled (a conversation's earlier turns, a template's static text), the
  rest forked from it (``prefill(child, rest, parent=head)``);
- ``pieces``: the prompt prefilled in three other pieces through two forks: the same numbers as ``cold`` but for
  summation order and KV copies, so the **numeric floor** every reuse is judged against;
- ``prefix-hit``: the same prompt prefilled twice: the second finds its block-aligned prefix in the engine's prefix
  cache and fills only the tail (the cached count is checked);
- ``branch_hit`` (not in ``PATHS``): the prompt's head found as a prefix of a longer cached prompt;
- ``host`` and ``disk``: the prompt's prefix restored from a KV tier (``kv_store``): ``host`` after an evictor
  prompt pushed it from the cells to host memory; ``disk`` on an engine restarted on the data dir a previous one
  saved it in (``restored``). The tier's hit count in ``engine.stats()`` is checked.

The host path needs an engine whose cells hold one prompt at most (``reuse_options``) and an evictor prompt
(``evictor``); the engine's prefix cache then keeps the longest prompt, and the evictor, of that size, pushes out
whatever else it holds.
"""

from __future__ import annotations

import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from headrace.plugins.engines.kvreuse.prefix_cache import BLOCK, common_prefix
from headrace.plugins.protocols import SamplingParams

COLD, FORK, PIECES, PREFIX_HIT, HOST, DISK = "cold", "fork", "pieces", "prefix-hit", "host", "disk"
PATHS = (COLD, PREFIX_HIT, FORK, HOST, DISK, PIECES)
TIERS = {HOST: "host", DISK: "disk"}

if TYPE_CHECKING:
    import torch


class PathNotTaken(RuntimeError):
    """The engine served the prompt by another route than the path asked for (a cache hit on a cold prefill, a
    prefill where a restore was asked): its rows would measure the wrong thing."""


@dataclass
class PathRun:
    rows: "torch.Tensor"  # (len(answer), vocab) log-softmax, float32
    cached: int  # prompt tokens the path did not compute: the evidence it was taken
    prefill_s: float  # the path's own prefill call (the last one): a restore and the tail, a fork's child...
    prompt_tokens: int
    greedy: list[int] | None = None  # the engine's own greedy continuation from the same context
    decode_s: float = 0.0  # from the first greedy token to the last
    decode_tokens: int = 0  # tokens decoded in that time (the first excluded)


def block_prefix(n: int, block: int = BLOCK) -> int:
    """The prompt tokens a cached prefix serves for an ``n``-token prompt: whole blocks, the last token always
    computed (its logits start the answer)."""
    return (n - 1) // block * block


async def _fill(engine: Any, tokens: Sequence[int], parent: Any = None) -> tuple[Any, int, float]:
    ctx = engine.new_context_id()
    start = time.perf_counter()
    cached = await engine.prefill(ctx, list(tokens), parent)
    return ctx, int(cached or 0), time.perf_counter() - start


async def _finish(engine: Any, ctx: Any, prompt_tokens: int, cached: int, prefill_s: float, answer: Sequence[int],
                  greedy: int, also_free: Sequence[Any] = ()) -> PathRun:
    """Score ``answer`` on ``ctx``, decode ``greedy`` tokens from it, free it (and ``also_free``)."""
    try:
        scored = await engine.prompt_logprobs(list(answer), parent=ctx, full=True)
        run = PathRun(scored.rows, cached, prefill_s, prompt_tokens)
        if greedy:
            params = SamplingParams(max_tokens=greedy, temperature=0, ignore_eos=True)
            tokens: list[int] = []
            first = last = None
            async with aclosing(engine.decode(ctx, params)) as stream:
                async for delta in stream:
                    now = time.perf_counter()
                    if first is None:
                        first, first_count = now, len(delta.token_ids)
                    last = now
                    tokens += delta.token_ids
            run.greedy = tokens
            run.decode_s = (last - first) if first is not None else 0.0
            run.decode_tokens = len(tokens) - first_count if first is not None else 0
        return run
    finally:
        for c in (ctx, *also_free):
            await engine.free(c)


async def cold(engine: Any, prompt: Sequence[int], answer: Sequence[int], *, greedy: int = 0) -> PathRun:
    ctx, cached, seconds = await _fill(engine, prompt)
    if cached:
        await engine.free(ctx)
        raise PathNotTaken(f"a cold prefill found {cached} of {len(prompt)} tokens cached")
    return await _finish(engine, ctx, len(prompt), 0, seconds, answer, greedy)


async def fork(engine: Any, prompt: Sequence[int], answer: Sequence[int], split: int, *, greedy: int = 0) -> PathRun:
    if not 0 < split < len(prompt):
        raise ValueError(f"a fork point must be inside the prompt (1 to {len(prompt) - 1}), not {split}")
    head, _, _ = await _fill(engine, prompt[:split])
    try:
        child, _, seconds = await _fill(engine, prompt[split:], head)
    except BaseException:
        await engine.free(head)
        raise
    return await _finish(engine, child, len(prompt), split, seconds, answer, greedy, also_free=[head])


async def pieces(engine: Any, prompt: Sequence[int], answer: Sequence[int], cuts: tuple[int, int], *,
                 greedy: int = 0) -> PathRun:
    a, b = cuts
    if not 0 < a < b < len(prompt):
        raise ValueError(f"cut points must be inside the prompt and in order, not {cuts}")
    held: list[Any] = []
    try:
        first, _, _ = await _fill(engine, prompt[:a])
        held.append(first)
        second, _, _ = await _fill(engine, prompt[a:b], first)
        held.append(second)
        last, _, seconds = await _fill(engine, prompt[b:], second)
    except BaseException:
        for c in held:
            await engine.free(c)
        raise
    return await _finish(engine, last, len(prompt), b, seconds, answer, greedy, also_free=held)


async def prefix_hit(engine: Any, prompt: Sequence[int], answer: Sequence[int], *, greedy: int = 0,
                     block: int = BLOCK) -> PathRun:
    """The prompt prefilled once (its prefix cached as it ends), then again: the second must find it all cached
    but the tail past the last whole block."""
    warm, _, _ = await _fill(engine, prompt)
    await engine.free(warm)
    ctx, cached, seconds = await _fill(engine, prompt)
    if cached < block_prefix(len(prompt), block) or cached == 0:
        await engine.free(ctx)
        raise PathNotTaken(f"a repeated prompt of {len(prompt)} tokens found {cached} cached, not "
                           f"{block_prefix(len(prompt), block)}")
    return await _finish(engine, ctx, len(prompt), cached, seconds, answer, greedy)


async def branch_hit(engine: Any, prompt: Sequence[int], answer: Sequence[int], head: int, other: Sequence[int], *,
                     greedy: int = 0, block: int = BLOCK) -> PathRun:
    """The prompt's first ``head`` tokens then ``other`` prefilled (and cached), then the prompt: its block-aligned
    head is a hit on a *prefix* of that longer entry (one system prompt or document before different questions)
    and the rest is computed. The engine's cache should hold nothing else of the prompt. On a sliding-window model
    the longer entry's window layers may have dropped what the head's continuation attends
    (``plugins/engines/llama_cpp/swa``): the engine must compute it whole (``PathNotTaken`` here) or be right."""
    if not block <= head < len(prompt):
        raise ValueError(f"a shared head must be a block or more and inside the prompt, not {head}")
    longer, _, _ = await _fill(engine, list(prompt[:head]) + list(other))
    await engine.free(longer)
    ctx, cached, seconds = await _fill(engine, prompt)
    # Whole blocks of the head, or (an engine that reuses to the token) as far as the prompt and the entry agree.
    if not head // block * block <= cached <= head + common_prefix(other, prompt[head:]) or cached == 0:
        await engine.free(ctx)
        raise PathNotTaken(f"a prompt sharing its first {head} tokens with a longer cached one found {cached} "
                           f"cached, not {head // block * block}")
    return await _finish(engine, ctx, len(prompt), cached, seconds, answer, greedy)


async def restored(engine: Any, prompt: Sequence[int], answer: Sequence[int], tier: str, *, greedy: int = 0,
                   block: int = BLOCK) -> PathRun:
    """The prompt prefilled where a KV tier (``host`` or ``disk``) holds its prefix and the cells do not: it must be
    restored from that tier (its hit count rises by one) and only the tail computed."""
    key = f"kv_store_{tier}_hits"
    before = engine.stats().get(key, 0)
    ctx, cached, seconds = await _fill(engine, prompt)
    hits = engine.stats().get(key, 0) - before
    if hits != 1 or cached < block_prefix(len(prompt), block) or cached == 0:
        await engine.free(ctx)
        raise PathNotTaken(f"a prompt of {len(prompt)} tokens expected from the {tier} tier: {hits} {tier} hits, "
                           f"{cached} tokens cached")
    return await _finish(engine, ctx, len(prompt), cached, seconds, answer, greedy)


async def host(engine: Any, prompt: Sequence[int], answer: Sequence[int], evictor_tokens: Sequence[int], *,
               greedy: int = 0, block: int = BLOCK) -> PathRun:
    """The prompt prefilled (its prefix cached), the evictor prefilled (its prefix takes the cells' room: the
    prompt's goes to host memory), then the prompt restored from host memory."""
    for tokens in (prompt, evictor_tokens):
        ctx, _, _ = await _fill(engine, tokens)
        await engine.free(ctx)
    return await restored(engine, prompt, answer, TIERS[HOST], greedy=greedy, block=block)


def cells_room(longest: int, block: int = BLOCK) -> int:
    """A prefix cache budget that holds the longest prompt's cached prefix and nothing beside it (whole blocks)."""
    return -(-longest // block) * block


def reuse_options(plugin: str, room: int, host_mib: int, disk_mib: int) -> dict[str, Any]:
    """Engine options for the reuse paths: a prefix cache of ``room`` tokens (``cells_room``), no pins, and the
    tiers (``disk_mib`` 0: no disk tier). llama-cpp: two cached prefixes at most (the evictor and one prompt)."""
    opts: dict[str, Any] = {"prefix_cache_tokens": room, "prefix_cache_pin_tokens": 0, "kv_host_mib": host_mib,
                            "kv_disk_mib": disk_mib}
    if plugin == "llama-cpp":
        opts["prefix_cache_sequences"] = 2
    return opts


def evictor(engine: Any, room: int) -> list[int]:
    """A prompt of ``room`` tokens (whole blocks) sharing no block with any real prompt: prefilled, it takes a cache
    of ``room`` tokens for itself, whether the engine keeps whole blocks or every token. Restored from the tiers
    after its first prefill, it costs little the next times."""
    words = " ".join(f"evict{i}" for i in range(room))
    # A user turn after it: some templates (Gemma 3's) fold a system message into the first user turn and drop it
    # when there is none.
    tokens = engine.chat_tokens([{"role": "system", "content": f"Evictor. {words}"},
                                 {"role": "user", "content": "Evict."}])
    if len(tokens) < room:
        raise ValueError(f"an evictor of {room} tokens needs more words")
    return list(tokens[:room])


__all__ = ["PATHS", "COLD", "FORK", "PIECES", "PREFIX_HIT", "HOST", "DISK", "PathNotTaken", "PathRun", "cold", "fork",
           "pieces", "prefix_hit", "branch_hit", "restored", "host", "block_prefix", "cells_room", "reuse_options",
           "evictor"]
