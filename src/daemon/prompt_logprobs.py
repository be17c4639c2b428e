"""Teacher-forced prompt scores on the OpenAI routes: completions' ``echo`` (the prompt's text first in each
choice, and with ``logprobs`` its tokens' scores first) and vLLM's ``prompt_logprobs`` (completions and chat).

The engine scores a prompt in one forward pass (``ScoresPrompts.prompt_logprobs``), through its LLM
scheduler, so the scoring is admitted and ranked as every other LLM request is; what the request then
generates runs as a plain request does. lm-evaluation-harness's ``local-completions`` reads loglikelihoods
this way: token-id prompts, ``echo``, ``logprobs: 1`` and ``max_tokens`` 0 or 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import anyio
from starlette.requests import Request

from headrace.batching.meta import PrimitiveMeta
from headrace.daemon import bodies as rq
from headrace.daemon.errors import bad_request, internal
from headrace.daemon.logprobs import CompletionLogprobs, TokenStrings, joined, prompt_logprobs
from headrace.daemon.openai_schemas import ChatCompletionRequest, CompletionRequest
from headrace.daemon.services import daemon, services
from headrace.graph.executor import new_run_id
from headrace.plugins.protocols import ScoresPrompts, TokenLogprob



@dataclass(frozen=True)
class ScoringPlan:
    """What a request asks of its prompts besides generating."""

    echo: bool  # completions: each choice's text (and logprobs) starts with its prompt's
    logprobs: int | None  # echo's alternatives per prompt token (the request's logprobs); None: no scores echoed
    prompt_logprobs: int | None  # vLLM's: alternatives per prompt token; None: not asked
    generate: bool = True  # False: max_tokens 0 with echo, only the prompt comes back

    @property
    def scores(self) -> bool:
        """Whether the engine must score the prompts (echo alone is only text)."""
        return self.logprobs is not None or self.prompt_logprobs is not None

    @property
    def top(self) -> int:
        return max(self.logprobs or 0, self.prompt_logprobs or 0)


@dataclass
class ScoredPrompt:
    """One prompt as a choice echoes it."""

    tokens: list[int]
    text: str  # what echo puts first: the prompt as sent, or a token-id prompt decoded
    scores: Sequence[TokenLogprob | None] = ()
    ranks: Sequence[int | None] = ()


def completion_plan(slot: Any, body: CompletionRequest, spec: rq.StreamSpec) -> ScoringPlan | None:
    """The echo and prompt_logprobs of a completions request (None: neither); 400 for what cannot be served."""
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens == 0 and not body.echo:
        raise bad_request(f"'{param}' must be at least 1 (0 only with 'echo': true, which scores the prompt alone)",
                          param=param)
    if not body.echo and body.prompt_logprobs is None:
        return None
    plan = ScoringPlan(bool(body.echo), body.logprobs if body.echo else None, body.prompt_logprobs, max_tokens != 0)
    _check(slot, plan, spec, "echo")
    return plan


def chat_plan(slot: Any, body: ChatCompletionRequest, spec: rq.StreamSpec) -> ScoringPlan | None:
    if body.prompt_logprobs is None:
        return None
    plan = ScoringPlan(False, None, body.prompt_logprobs)
    _check(slot, plan, spec, "prompt_logprobs")
    return plan


def _check(slot: Any, plan: ScoringPlan, spec: rq.StreamSpec, param: str) -> None:
    if plan.prompt_logprobs is not None and spec.stream:
        raise bad_request("'prompt_logprobs' is not available with 'stream': true (vLLM's rule too)",
                          param="prompt_logprobs")
    if plan.scores and not (isinstance(slot.engine, ScoresPrompts) and slot.engine.scores_prompts):
        what = "prompt_logprobs" if plan.prompt_logprobs is not None else param
        raise bad_request(f"the model '{slot.name}' cannot score prompts ('{what}' needs log-probabilities of the "
                          "prompt's tokens)", param=what, code="unsupported_parameter")


async def prompts_as_sent(slot: Any, tokens: list[list[int]], sent: list[str | list[int]]) -> list[ScoredPrompt]:
    """Each prompt's tokens with its text: a text prompt as sent, a token-id one decoded (as vLLM echoes it)."""
    ids = [t for t, s in zip(tokens, sent) if not isinstance(s, str)]
    decoded = iter(await rq.off_loop_if_large(sum(map(len, ids)) * 4, _decode_all, slot.engine, ids) if ids else [])
    return [ScoredPrompt(t, s if isinstance(s, str) else next(decoded)) for t, s in zip(tokens, sent)]


def _decode_all(engine: Any, prompts: list[list[int]]) -> list[str]:
    return [engine.tokenizer.decode(p) for p in prompts]


async def score(request: Request, slot: Any, prompts: list[ScoredPrompt], plan: ScoringPlan,
                program: str | None, partition: str = "") -> bool:
    """Score ``prompts`` in place, as one run through the engine's scheduler, all at once (the engine batches
    them); False when the client disconnected first (the scoring is cancelled, its engine work freed)."""
    registry = services(request).programs
    meta = PrimitiveMeta(run=daemon(request).workflows.id_prefix + new_run_id(), program=program,
                         attained_tokens=registry.attained(program), cache_partition=partition)
    failed: list[BaseException] = []
    gone = False

    async def some(chosen: list[ScoredPrompt]) -> None:
        try:
            for prompt in chosen:
                scored = await slot.scheduler.prompt_logprobs(prompt.tokens, top=plan.top, meta=meta)
                prompt.scores = scored.logprobs
                if plan.prompt_logprobs is not None:
                    prompt.ranks = [None if lp is None else lp.rank for lp in scored.logprobs]
        except Exception as exc:  # kept, and raised outside the task group, so it is not wrapped in a group
            failed.append(exc)

    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            nonlocal gone
            while (await request.receive())["type"] != "http.disconnect":
                pass
            gone = True
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        async with anyio.create_task_group() as work:
            for prompt in prompts:
                work.start_soon(some, [prompt])
        tg.cancel_scope.cancel()
    if not gone:
        registry.add(program, sum(len(p.tokens) for p in prompts))
    if failed:
        raise internal(failed[0], "scoring the prompt")
    return not gone


def completion_choice(choice: dict[str, Any], prompt: ScoredPrompt, plan: ScoringPlan, strings: TokenStrings | None,
                      output: Sequence[TokenLogprob]) -> dict[str, Any]:
    """A completions choice, built as without echo, with its prompt's part put first (``strings``: given
    whenever the plan scores)."""
    if plan.echo:
        choice["text"] = prompt.text + choice["text"]
        if plan.logprobs is not None and strings is not None:
            lp = CompletionLogprobs(strings)
            choice["logprobs"] = joined(lp.add_prompt(prompt.tokens, prompt.scores, plan.logprobs), lp.add(output))
    if plan.prompt_logprobs is not None and strings is not None:
        choice["prompt_logprobs"] = vllm_entries(prompt, plan, strings)
    return choice


def echo_chunk(index: int, prompt: ScoredPrompt, plan: ScoringPlan, offsets: CompletionLogprobs | None
               ) -> dict[str, Any]:
    """A streamed choice's first chunk: its prompt (vLLM streams an echo so), and with max_tokens 0 its end."""
    logprobs = None
    if plan.logprobs is not None and offsets is not None:
        logprobs = offsets.add_prompt(prompt.tokens, prompt.scores, plan.logprobs)
    return {"index": index, "text": prompt.text, "logprobs": logprobs,
            "finish_reason": None if plan.generate else "length"}


def vllm_entries(prompt: ScoredPrompt, plan: ScoringPlan, strings: TokenStrings) -> list[Any]:
    return prompt_logprobs(prompt.tokens, prompt.scores, prompt.ranks, plan.prompt_logprobs or 0, strings)
