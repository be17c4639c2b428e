"""Engine protocols: one small async protocol per engine kind.

Engines are created by factories that plugins register through
``register_engines``; every call reaches them through their scheduler in
``headrace.batching``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Literal, Mapping, Protocol, Sequence, runtime_checkable

from headrace.types import BatchObserver, ContextId, Options, TokenIds

if TYPE_CHECKING:
    import torch

EngineKind = Literal["llm", "embed", "rerank", "vector_store"]


@dataclass(frozen=True)
class EngineSpec:
    """One ``[[engines]]`` entry of the config, as a factory receives it."""

    name: str
    plugin: str
    model: str = ""
    options: Options = field(default_factory=dict)


@dataclass
class EngineEnv:
    """What the daemon gives an engine factory besides its own spec."""

    data_dir: Path
    cache_dir: Path
    # Resolves another configured engine by name (an LLM reranker uses its LLM).
    lookup: Callable[[str], Any]
    observe_batch: BatchObserver = lambda op, size, start, end: None
    # Another LLM engine behind its scheduler (a ``ScheduledScoring``): an engine that calls an LLM (the
    # LLM reranker) goes through it, so its calls are admitted and ranked like every LLM primitive.
    # None outside a daemon (an engine used on its own): call the engine itself.
    lookup_scheduled: Callable[[str], "ScheduledScoring"] | None = None


@runtime_checkable
class Engine(Protocol):
    """Every engine: a name, a kind, and an async lifetime.

    ``run`` loads the model, reports readiness through ``task_status.started()``,
    serves until cancelled, and releases its resources on the way out.
    """

    name: str
    kind: EngineKind

    async def run(self, *, task_status: Any) -> None: ...


@runtime_checkable
class Reloadable(Protocol):
    """An engine that can be unloaded and loaded again: the daemon may evict it under a memory budget.

    Unloading is cancelling ``run``: on the way out the engine releases its model's memory but keeps
    what is cheap and needed to check requests (tokenizer, vocabulary size, context limit), and a
    later ``run`` on the same object loads the model again. An engine that is not ``Reloadable``
    cannot be unloaded and stays pinned, as does one whose ``reloadable`` is False (an LLM front over a
    core that cannot drop its model).
    """

    reloadable: bool

    def footprint_bytes(self) -> int:
        """Bytes the loaded model holds by the engine's own count (weights, preallocated caches); 0 unloaded."""
        ...


# ----- LLM -------------------------------------------------------------------


# The seeds a 64-bit generator takes (torch.Generator.manual_seed): negative ones wrap around.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# The most alternatives a sampled token's log-probability comes with (OpenAI's top_logprobs bound, vLLM's default).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class JsonSchemaConstraint:
    """Constrained decoding: the output is one JSON value that matches ``schema``.

    ``schema`` is the JSON Schema as compact JSON text (key order kept: it is the order the
    output's properties are written in), so that an engine can cache what it compiled by it.
    ``{"type": "object"}`` is OpenAI's ``json_object`` mode.
    """

    schema: str

    def __post_init__(self) -> None:
        if not self.schema:
            raise ValueError("a JSON schema constraint needs a schema")


@dataclass(frozen=True)
class LarkConstraint:
    """Constrained decoding by a context-free grammar in llguidance's Lark syntax (which embeds
    JSON schemas with ``%json``): how a tool call wrapped in the chat template's tags is constrained."""

    grammar: str

    def __post_init__(self) -> None:
        if not self.grammar:
            raise ValueError("a grammar constraint needs a grammar")


OutputConstraint = JsonSchemaConstraint | LarkConstraint

# A request's output length when its caller sets none (an OpenAI chat with no max_tokens too: OpenAI
# itself documents none for chat).
DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # None: no log-probabilities; k >= 0: each sampled token's, with its k most likely alternatives.
    logprobs: int | None = None
    # The output must match it (every engine enforces it with a token mask); None: free text.
    constraint: OutputConstraint | None = None
    # OpenAI's penalties, on the tokens generated so far: each logit less count * frequency_penalty and
    # (count > 0) * presence_penalty.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's (and HF's), on the tokens of the prompt and the output: a positive logit divided by it, a negative
    # one multiplied by it. 1: off.
    repetition_penalty: float = 1.0
    top_k: int = 0  # the k most likely tokens only; 0 or -1: all (vLLM's)
    min_p: float = 0.0  # tokens less likely than min_p times the most likely one are dropped; 0: off
    # (token id, bias) pairs added to the logits (OpenAI's logit_bias); a mapping given is kept as sorted pairs.
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output (nor stop strings) before this many tokens
    ignore_eos: bool = False  # EOS does not end the output (vLLM's; a benchmark's fixed lengths)
    # Generating one ends the output (finish "stop"); it is in the token ids, not in the text (vLLM's).
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.logit_bias, Mapping):
            object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b))
                                                                for t, b in self.logit_bias.items())))
        else:
            object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        object.__setattr__(self, "stop_token_ids", tuple(dict.fromkeys(int(t) for t in self.stop_token_ids)))
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError("temperature must be a finite number >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        # vLLM's ranges (SamplingParams._verify_args).
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2]")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError("repetition_penalty must be a finite number > 0")
        if self.top_k < -1:
            raise ValueError("top_k must be 0 or -1 (off), or at least 1")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if any(t < 0 for t, _ in self.logit_bias) or any(t < 0 for t in self.stop_token_ids):
            raise ValueError("token ids in logit_bias and stop_token_ids must be >= 0")
        if any(math.isnan(b) for _, b in self.logit_bias):
            raise ValueError("a logit_bias value must be a number")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")

    @property
    def neutral_logits(self) -> bool:
        """Whether the logits reach the sampler as the model made them (no bias, penalty or min_tokens):
        such a row costs the sampler nothing extra, and a greedy one is its argmax."""
        return (not self.logit_bias and not self.min_tokens and self.repetition_penalty == 1
                and not self.presence_penalty and not self.frequency_penalty)


FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model (log_softmax of its raw logits), and the
    most likely alternatives at that step, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    # Its rank in the distribution (1: the most likely; vLLM's), where the engine counted it (teacher-forced
    # scores do); None: not counted.
    rank: int | None = None


@dataclass(frozen=True)
class TokenDelta:
    """New output of one decode step (or several, when coalesced)."""

    text: str
    token_ids: TokenIds
    finish_reason: FinishReason | None = None
    # One per token of ``token_ids`` when the request asked for ``logprobs``; empty otherwise.
    logprobs: tuple[TokenLogprob, ...] = ()
    # Prompt tokens the engine found in its prefix cache and did not compute (OpenAI's ``usage.
    # prompt_tokens_details.cached_tokens``): on a request's first delta only, 0 on the rest and on an
    # engine that does not say. ``las`` counts a program's service as the tokens computed, not the ones sent.
    cached_tokens: int = 0

    def then(self, later: TokenDelta) -> TokenDelta:
        """This delta and the ``later`` one of the same stream as one (text appended, ids and logprobs extended,
        the latest finish reason kept)."""
        return TokenDelta(text=self.text + later.text, token_ids=[*self.token_ids, *later.token_ids],
                          finish_reason=later.finish_reason or self.finish_reason,
                          logprobs=self.logprobs + later.logprobs,
                          cached_tokens=self.cached_tokens + later.cached_tokens)


Priority = int
"""Which LLM work an engine runs first when it cannot run everything at once: lower first, ties in
arrival order (vLLM's and SGLang's priority scheduling). The LLM scheduler's policy sets it."""


@runtime_checkable
class LLMEngine(Engine, Protocol):
    """Fill / Generate / FreeContext, after Parrot's engine API.

    Every call takes a keyword-only ``priority``: each iteration the engine picks the prefills,
    scoring prompts and joining decodes it runs by it, within its token budget.
    """

    def encode(self, text: str) -> TokenIds:
        """A piece of a prompt, no special tokens added (pieces are concatenated into one prompt)."""
        ...

    def prompt_tokens(self, text: str) -> TokenIds:
        """A whole prompt as the model's tokenizer makes it (``tokenizer(text)``): its special tokens added, a BOS
        where the model's tokenizer adds one."""
        ...

    def chat_tokens(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
                    add_generation_prompt: bool = True) -> TokenIds:
        """Apply the model's chat template, ready for the assistant's turn (unless ``add_generation_prompt`` is
        false: the messages alone).

        ``messages`` in Hugging Face's chat format (assistant ``tool_calls``, ``tool`` results included);
        ``tools``: OpenAI tool objects the prompt offers (``headrace.plugins.engines.llm.chat``). A model with no
        chat template raises ``chat.NoChatTemplate`` (a 400 naming the ``chat_template`` option)."""
        ...

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
                    ) -> str:
        """The chat template applied as text (special tokens spelled out), ready for the assistant's turn."""
        ...

    def new_context_id(self) -> ContextId:
        """A context id no other context of this engine has, for ``prefill``."""
        ...

    async def prefill(self, ctx: ContextId, tokens: Sequence[int], parent: ContextId | None = None, *,
                      priority: Priority = 0) -> int | None:
        """Fill a new KV context; a child reuses its parent's KV as its prefix. Returns how many of ``tokens``
        were found in the engine's prefix cache (None: the engine does not say; counted as none)."""
        ...

    def decode(self, ctx: ContextId, params: SamplingParams, *, priority: Priority = 0) -> AsyncIterator[TokenDelta]:
        """Yield token deltas; leaving the iterator early frees the decode slot."""
        ...

    async def free(self, ctx: ContextId) -> None: ...

    def generate(self, tokens: Sequence[int], params: SamplingParams, *,
                 priority: Priority = 0) -> AsyncIterator[TokenDelta]:
        """Prefill, decode and free in one call."""
        ...

    async def next_token_logits(self, prompts: Sequence[Sequence[int]], token_ids: Sequence[int], *,
                                priority: Priority = 0) -> "torch.Tensor":
        """Prefill-only scoring: logits of ``token_ids`` after each prompt, shape (len(prompts), len(token_ids))."""
        ...


@dataclass(frozen=True)
class PromptLogprobs:
    """Teacher-forced scores of a token sequence: each token's log-probability given everything before it
    (vLLM's ``prompt_logprobs``, OpenAI's ``echo`` with ``logprobs``).

    ``logprobs[i]`` scores ``tokens[i]``; None where nothing precedes it (the first token of a sequence with
    no parent context). ``rows`` (asked for with ``full``): the whole log-softmax distribution each token was
    drawn from, shape (len(tokens), vocab), float32, NaN in a row with no score: what a quality measurement
    compares (KL divergence) against a reference's."""

    logprobs: tuple[TokenLogprob | None, ...]
    rows: "torch.Tensor | None" = None
    cached_tokens: int = 0  # always 0 today: a scored prompt is computed whole (vLLM skips its prefix cache too)


@runtime_checkable
class ScoresPrompts(Protocol):
    """An LLM engine that scores a token sequence teacher-forced (every position's logits, one forward pass),
    when ``scores_prompts`` is true (an engine on the shared front whose core cannot says false)."""

    scores_prompts: bool

    async def prompt_logprobs(self, tokens: Sequence[int], *, parent: ContextId | None = None, top: int = 0,
                              full: bool = False, priority: Priority = 0) -> PromptLogprobs:
        """Score ``tokens``, each given the ones before it; with ``parent`` (a prefilled context that has not
        decoded) they continue its KV, so ``tokens[0]`` is scored by the parent's last logits and the parent's
        prompt came by whatever path filled it (cold, a prefix-cache hit, a fork, a KV tier's restore).
        ``top``: each score's most likely alternatives (at most ``MAX_TOP_LOGPROBS``); ``full``: the whole rows."""
        ...


@runtime_checkable
class ReportsLogprobs(Protocol):
    """An LLM engine whose decodes honour ``SamplingParams.logprobs`` (``TokenDelta.logprobs``); the API refuses
    logprobs for one that does not, rather than answer none."""

    reports_logprobs: bool


@runtime_checkable
class PausesDecodes(Protocol):
    """An LLM engine that preempts (Autellix): its ``prefill``, ``decode`` and ``generate`` also take a
    keyword-only ``preemptive`` flag, which the LLM scheduler sets under a policy that preempts (``las``).
    When ``pauses_decodes`` is true, a preemptive request that cannot get into the engine's batch may pause
    running preemptive decodes of a lower rank (a higher ``priority``): such a decode leaves the batch
    with its KV kept and later resumes where it stopped, its output unchanged. Requests sent without the
    flag neither pause nor are paused."""

    pauses_decodes: bool


@runtime_checkable
class KeepsContexts(Protocol):
    """An LLM engine whose prefix cache can keep a finished decode's whole context (prompt and output), for a
    next request that repeats it all (a named program's next turn): its ``decode`` and ``generate`` also take a
    keyword-only ``keep_context`` flag, which the LLM scheduler sets for a request of a named program
    (``PrimitiveMeta.program``). Keeping one costs a KV copy, so a request without the flag (a workflow's map
    prompt, a plain chat) leaves only its prompt cached. Requests sent without it keep nothing more."""

    keeps_contexts: bool


@runtime_checkable
class IsolatesCaches(Protocol):
    """An LLM engine whose cached KV (prefix cache, retained contexts, KV tiers, on disk too) is partitioned, when
    ``isolates_caches`` is true (issue 50, vLLM's ``cache_salt``): its ``prefill``, ``generate``,
    ``prompt_logprobs`` and ``pin_prefix`` also take a keyword-only ``cache_partition`` string ("" the shared
    partition, what a call without it gets), and a request reuses, waits for and pins only KV that requests of
    its own partition left: across partitions its prompt counts no cached tokens and no tier hit. The LLM
    scheduler sends it from ``PrimitiveMeta.cache_partition``, and only when not empty."""

    isolates_caches: bool


@runtime_checkable
class PlacesDocuments(Protocol):
    """An LLM engine that can put a retrieved document's KV, computed once, wherever the document stands in a
    prompt (issue 49), when ``places_documents`` is true: ``prepare_documents`` computes and keeps documents' KV
    (each tokenized alone) in a cache partition, and its ``prefill`` also takes a keyword-only ``documents``
    tuple of (start, length) spans of the prompt, each a document tokenized alone. A placed document's KV is
    shifted to its position and its first tokens computed again in place (EPIC), so the prompt's numbers are
    close to a full prefill's, not equal (docs/benchmarks.md). A document it holds no KV for is prefilled."""

    places_documents: bool

    async def prepare_documents(self, documents: Sequence[Sequence[int]], *, cache_partition: str = "") -> int:
        ...


@runtime_checkable
class ScoresThroughCache(Protocol):
    """An LLM engine that can score prompts as it prefills them, when ``scores_through_cache`` is true: each
    prompt's cached prefix (cells or KV tiers, in its ``cache_partition``) is restored rather than computed, and
    what it computes is cached for the next. ``next_token_logits`` scores each prompt apart and reuses nothing; a
    scoring prompt that starts with a document and ends with a changing question (``llm-rerank``'s
    ``document_first``) computes each document once this way.

    Returns ``next_token_logits``' tensor and the prompt tokens found cached, summed over the prompts."""

    scores_through_cache: bool

    async def next_token_logits_cached(self, prompts: Sequence[Sequence[int]], token_ids: Sequence[int], *,
                                       priority: Priority = 0,
                                       cache_partition: str = "") -> tuple["torch.Tensor", int]:
        ...


@runtime_checkable
class ScheduledScoring(Protocol):
    """An LLM's scheduler, as an engine that scores with that LLM sees it."""

    async def next_token_logits(self, prompts: Sequence[Sequence[int]], token_ids: Sequence[int],
                                metas: Sequence[Any] = (), *, through_cache: bool = False) -> "torch.Tensor":
        """``LLMEngine.next_token_logits``, ranked by the most urgent of ``metas`` (the primitives asking, all of
        one cache partition when ``through_cache``); ``through_cache``: through the engine's prefix cache where it
        ``ScoresThroughCache``."""
        ...


@runtime_checkable
class PrefixCaching(Protocol):
    """An LLM engine whose automatic prefix caching can be switched at run time (benchmarks compare both)."""

    async def set_prefix_caching(self, enabled: bool) -> None:
        """On: reuse cached prefixes. Off: drop everything cached and cache nothing until switched on."""
        ...

    def prefix_caching_enabled(self) -> bool:
        """Whether prefixes are cached now."""
        ...


@runtime_checkable
class SizesPrefixCache(Protocol):
    """An LLM engine whose prefix cache's token budget (and its pins') can be set at run time: a benchmark's
    memory-pressure point on the same daemon."""

    def prefix_cache_budget(self) -> tuple[int, int]:
        """(The prefix cache's budget, its pins' budget) in tokens; (0, 0): configured without a prefix cache."""
        ...

    async def set_prefix_cache_budget(self, tokens: int, pin_tokens: int) -> None:
        """A new budget (``pin_tokens`` <= ``tokens``); what the cache holds is dropped."""
        ...


@runtime_checkable
class PinsPrefixes(Protocol):
    """An LLM engine whose prefix cache holds pinned prefixes (issue 28: retention across a program's pauses,
    clients' ``cache_control`` marks). Pinned entries are never evicted; a pin ends at its TTL."""

    async def pin_prefix(self, tokens: Sequence[int], ttl: float | None, *, owner: str | None = None,
                         next_use: float | None = None) -> int:
        """Pin the cached entry holding the longest prefix of ``tokens`` for ``ttl`` seconds (None: the
        engine's retention TTL for a context that long). ``owner``: the program retaining it (its earlier
        pin goes); ``next_use``: seconds until it is predicted back. The tokens pinned; 0: none."""
        ...

    async def unpin_prefix(self, owner: str) -> None:
        """The program ``owner`` no longer needs what it pinned."""
        ...


@runtime_checkable
class WorkerHeartbeat(Protocol):
    """An engine whose compute runs on a worker thread of its own (every in-process LLM engine).

    The daemon's watchdog asks it at every tick: an engine wedged inside a forward pass stops
    answering, and the daemon stops telling systemd it is alive.
    """

    async def heartbeat(self) -> None:
        """Return once the worker thread has come round its loop (after the iteration it is in)."""
        ...


# ----- embed / rerank ----------------------------------------------------------


@runtime_checkable
class EmbedEngine(Engine, Protocol):
    dimensions: int

    def count_tokens(self, texts: Sequence[str]) -> int: ...

    async def embed(self, texts: Sequence[str]) -> "torch.Tensor":
        """One row per text, L2-normalised, float32."""
        ...


@runtime_checkable
class TokenInput(Protocol):
    """An engine that also takes input as token ids of its own tokenizer (the OpenAI embeddings API's token arrays)."""

    vocab_size: int

    def decode_tokens(self, ids: Sequence[Sequence[int]]) -> list[str]:
        """The text each list of ids spells (special tokens dropped); ids are below ``vocab_size``."""
        ...


@runtime_checkable
class RerankEngine(Engine, Protocol):
    async def score(self, query: str, docs: Sequence[str]) -> "torch.Tensor":
        """One relevance score per document, higher is more relevant."""
        ...

    async def score_pairs(self, pairs: Sequence[tuple[str, str]], metas: Sequence[Any] = ()) -> "torch.Tensor":
        """One score per (query, document) pair: how a scheduler batches several requests.

        ``metas``: the batch's primitives (``PrimitiveMeta``, opaque here), for an engine that
        passes its work on to an LLM scheduler."""
        ...


@runtime_checkable
class WarmsDocuments(Protocol):
    """A rerank engine that can score documents before any query asks, so that scoring them for a query later
    restores what it computed (``llm-rerank`` reading the document first, on an LLM that ``ScoresThroughCache``):
    ``warms_documents`` says whether it does now; ``warm_documents`` scores each document once, ranked by
    ``metas`` (and in their cache partition), and says how many it scored (0 where it does not warm)."""

    warms_documents: bool

    async def warm_documents(self, docs: Sequence[str], metas: Sequence[Any] = ()) -> int:
        ...


# ----- vector store ------------------------------------------------------------


@dataclass(frozen=True)
class SearchHit:
    id: str
    score: float
    payload: dict[str, Any]


@runtime_checkable
class VectorStore(Engine, Protocol):
    async def ingest(self, collection: str, vectors: "torch.Tensor", payloads: Sequence[dict[str, Any]]) -> list[str]:
        """Add rows (created on first ingest); returns their ids."""
        ...

    async def search(self, collection: str, vectors: "torch.Tensor", k: int) -> list[list[SearchHit]]:
        """Nearest ``k`` rows per query vector."""
        ...

    async def search_text(self, collection: str, query: str, k: int) -> list[SearchHit]:
        """Full-text search over the payloads' ``text`` field."""
        ...

    async def drop(self, collection: str) -> None:
        """Delete a collection (a run's own, when the run ends); a missing one is no error."""
        ...
