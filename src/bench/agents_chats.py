"""One-call chats beside the ``agents`` benchmark's agents: a background stream, and a chat probe.

- **Background** (``--agents-background RATE``): Poisson arrivals of unrelated chats, each its own
  prefix (a system message naming the request, then text cut from the corpus, about
  ``background_tokens`` in all) and a short answer. They push the agents' contexts out of an LRU
  prefix cache while the agents' tools run, as the issue's held-out probe had "one unrelated
  prompt stream beside" its agents: without them the default cache holds every agent's context and
  retention has nothing to save.
- **Chat probe** (``--agents-chats RATE``): single-call chats of the same kind at a low rate, whose
  time to first token is set against an idle engine's, measured on the same kind of chat just before
  the point (issue 28's target: a one-call chat beside twelve-step agents within 1.5x of idle).

Both stream (``stream_options.include_usage``), so each chat's time to first token is the client's:
the first chunk with content or a finish reason (headrace sends the role chunk before the prefill).
Arrivals and prompts come from the seed: every mode gets the same sequence, sent from the point's
start until its last agent is done (a mode whose agents finish sooner sends fewer of it). A chat names
no program (a program of one call). Their counts are reported on their own and taken out of the
agents' figures (``exclude``).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Any, Iterator

import anyio

from headrace.bench.load import percentile

E2E_COUNT = ("headrace_e2e_request_latency_seconds_count", "")
TTFT_SUM, TTFT_COUNT = ("headrace_time_to_first_token_seconds_sum", ""), ("headrace_time_to_first_token_seconds_count", "")
PROMPT = ("headrace_prompt_tokens_total", "")
CACHED = ("headrace_prompt_cached_tokens_total", "")  # of those, not prefilled (cells, prefix cache or a KV tier)
QUERIES, HITS = ("headrace_prefix_cache_queries_total", ""), ("headrace_prefix_cache_hits_total", "")


@dataclass(frozen=True)
class ChatStream:
    """A stream of one-call chats: ``rate`` per second, prompts of about ``prompt_tokens``, ``max_tokens`` out."""

    name: str  # "background" or "chats" (the probe): also what its prompts are tagged with
    rate: float
    prompt_tokens: int
    max_tokens: int
    seed: int

    def arrivals(self) -> Iterator[float]:
        """Seconds from the point's start, Poisson, without end (the sender stops)."""
        rng, t = random.Random(f"{self.name}-{self.seed}"), 0.0
        while True:
            t += rng.expovariate(self.rate)
            yield t

    def messages(self, i: int, snippets: list[str], snippet_tokens: int, tag: str) -> list[dict[str, str]]:
        """Chat ``i``: its own first tokens (a system message naming it), then corpus text, then the question."""
        rng = random.Random(f"{self.name}-{self.seed}-{i}")
        count = max(1, round(self.prompt_tokens / max(1, snippet_tokens)))
        note = " ".join(rng.choice(snippets) for _ in range(count))
        return [{"role": "system", "content": f"Request {i} ({self.name}, {tag}). Answer briefly."},
                {"role": "user", "content": f"{note}\n\nWhat is this note about?"}]


@dataclass
class ChatSample:
    sent_at: float  # seconds from the stream's start
    ttft_s: float | None = None
    latency_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


async def one_chat(client: Any, model: str, messages: list[dict[str, str]], max_tokens: int,
                   sample: ChatSample) -> ChatSample:
    """One streamed chat through the openai SDK, timed into ``sample`` (an error is recorded, not raised)."""
    sent = time.perf_counter()
    try:
        stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True})
        async for chunk in stream:
            if sample.ttft_s is None and chunk.choices and (chunk.choices[0].delta.content
                                                            or chunk.choices[0].finish_reason):
                sample.ttft_s = time.perf_counter() - sent
            if chunk.usage is not None:
                sample.prompt_tokens = chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                sample.cached_tokens = (details.cached_tokens or 0) if details is not None else 0
        sample.latency_s = time.perf_counter() - sent
    except Exception as exc:
        sample.error = f"{type(exc).__name__}: {exc}"[:300]
    return sample


async def run_stream(client: Any, model: str, stream: ChatStream, snippets: list[str], snippet_tokens: int, tag: str,
                     stop: anyio.Event, drain_s: float) -> dict[str, Any]:
    """Send ``stream``'s chats from now until ``stop`` is set; wait (at most ``drain_s``) for those in flight."""
    samples: list[ChatSample] = []
    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i, at in enumerate(stream.arrivals()):
            with anyio.move_on_after(max(0.0, at - (time.perf_counter() - t0))):
                await stop.wait()
            if stop.is_set():
                break
            sample = ChatSample(at)
            samples.append(sample)
            tg.start_soon(one_chat, client, model, stream.messages(i, snippets, snippet_tokens, tag),
                          stream.max_tokens, sample)
        with anyio.move_on_after(drain_s) as drained:
            while any(s.latency_s is None and s.error is None for s in samples):
                await anyio.sleep(0.05)
        if drained.cancelled_caught:
            for s in samples:
                if s.latency_s is None and s.error is None:
                    s.error = "not finished when the drain time ran out"
            tg.cancel_scope.cancel()
    return summarize_chats(stream, samples)


async def idle_ttft(client: Any, model: str, stream: ChatStream, snippets: list[str], snippet_tokens: int, tag: str,
                    n: int) -> dict[str, Any]:
    """The stream's kind of chat on the idle engine, one at a time (each its own prefix: no cache hit but the
    template's opening): what its time to first token is with nothing beside it."""
    samples = [await one_chat(client, model, stream.messages(-1 - k, snippets, snippet_tokens, f"{tag}-idle"),
                              stream.max_tokens, ChatSample(0.0)) for k in range(n)]
    return summarize_chats(stream, samples)


def summarize_chats(stream: ChatStream, samples: list[ChatSample]) -> dict[str, Any]:
    done = [s for s in samples if s.latency_s is not None]
    ttfts = sorted(s.ttft_s for s in done if s.ttft_s is not None)
    latencies = sorted(s.latency_s for s in done if s.latency_s is not None)
    return {
        "rate": stream.rate, "prompt_tokens_target": stream.prompt_tokens, "max_tokens": stream.max_tokens,
        "sent": len(samples), "completed": len(done), "failed": len(samples) - len(done),
        "errors": sorted({s.error for s in samples if s.error})[:3],
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None, "ttft_p95_s": percentile(ttfts, 95),
        "ttft_sum_s": sum(ttfts), "ttft_count": len(ttfts),
        "latency_mean_s": statistics.fmean(latencies) if latencies else None,
        "latency_p95_s": percentile(latencies, 95),
        "prompt_tokens": sum(s.prompt_tokens for s in done), "cached_tokens": sum(s.cached_tokens for s in done),
    }


def exclude(delta: dict[tuple[str, str], float], streams: list[dict[str, Any]]) -> dict[tuple[str, str], float]:
    """The daemon's metric deltas less what ``streams``' chats added: the agents' own. Requests, prompt tokens and
    prefix-cache queries and hits and the cached prompt tokens subtract exactly (each chat's ``usage`` says its prompt and cached tokens, which
    the cache counted as queried and hit); the time-to-first-token sum less the chats' client-side times (which
    include the HTTP round trip, so the agents' mean left errs low by that much). The histogram's buckets cannot
    be split: its count and sum only."""
    out = dict(delta)
    for s in streams:
        out[E2E_COUNT] = out.get(E2E_COUNT, 0.0) - s["completed"]
        out[PROMPT] = out.get(PROMPT, 0.0) - s["prompt_tokens"]
        if CACHED in out:
            out[CACHED] -= s["cached_tokens"]
        if out.get(QUERIES, 0.0) > 0:  # the cache was on: every chat's prompt was looked up
            out[QUERIES] -= s["prompt_tokens"]
            out[HITS] = out.get(HITS, 0.0) - s["cached_tokens"]
        out[TTFT_SUM] = out.get(TTFT_SUM, 0.0) - s["ttft_sum_s"]
        out[TTFT_COUNT] = out.get(TTFT_COUNT, 0.0) - s["ttft_count"]
    return out
