"""Rerank engines: a sentence-transformers cross-encoder and a pointwise LLM judge.

``cross-encoder`` scores (query, doc) pairs with a ``CrossEncoder`` loaded from
the directory in ``engines.<name>.model``; scores are the raw logits.
Options: ``batch_size`` (default 32), ``device`` (default "cpu").

``llm-rerank`` asks another configured LLM engine (``options.llm``) whether each
document is relevant and scores it sigmoid(logit "yes" - logit "no") from one
prefill-only scoring job over the whole batch (the LLM scores it in chunks,
between its decode steps). Options: ``llm`` (required), ``max_doc_tokens``
(default 384) and ``max_query_tokens`` (default 128): longer documents and
queries are cut to that many tokens, so one request's work stays bounded.
``document_first`` (default true): each prompt puts the document before the
query, and an LLM that ``ScoresThroughCache`` prefills it through its prefix
cache and KV tiers, so a document scored once (for any query) is restored the
next time rather than computed again (issue 49: documents prefilled once). The
order changes the judge's input: its ranking, measured against the query first
(``scripts/bench/rerank_order.py``, docs/benchmarks.md), is the better one.

Texts that are not valid Unicode (a lone surrogate such as "\ud800") are
refused with a ValueError naming the pair, before any model work.

Both also take ``score_pairs(pairs)``, (query, doc) pairs with mixed queries,
which is how the daemon's batch scheduler hands them several requests at once.
"""

from __future__ import annotations

import time
from typing import Any, Generator, Sequence

import anyio
import torch

from headrace.plugins.engines.models.paths import resolve_model
from headrace.plugins.engines.retrieval.own_thread import run_in_own_thread
from headrace.plugins.hookspecs import hookimpl
from headrace.plugins.protocols import EngineEnv, EngineSpec, LLMEngine, ScoresThroughCache
from headrace.text import check_texts

# ----- cross-encoder -----------------------------------------------------------


class CrossEncoderReranker:
    """A ``RerankEngine`` over a local sentence-transformers CrossEncoder."""

    kind = "rerank"

    def __init__(self, spec: EngineSpec, env: EngineEnv) -> None:
        self.name = spec.name
        self._env = env
        key = f"engines.{spec.name}.model"
        if not spec.model:
            raise ValueError(f"{key} is required for a cross-encoder: set it to a CrossEncoder model directory.")
        self.path = resolve_model(spec.model, key=key)
        self._batch_size = int(spec.options.get("batch_size", 32))
        self._device = str(spec.options.get("device", "cpu"))
        # One batch at a time on the device.
        self._limiter = anyio.CapacityLimiter(1)
        self._model: Any = None

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            self._model = await run_in_own_thread(self._load)
            task_status.started()
            await anyio.sleep_forever()
        finally:
            self._model = None

    def _load(self) -> Any:
        from sentence_transformers import CrossEncoder

        # Identity: raw logits, so scores from different models are not squashed
        # differently depending on what each saved as its default activation.
        model = CrossEncoder(
            str(self.path), device=self._device, local_files_only=True, activation_fn=torch.nn.Identity()
        )
        model.eval()
        return model

    async def score(self, query: str, docs: Sequence[str]) -> torch.Tensor:
        return await self.score_pairs([(query, doc) for doc in docs])

    async def score_pairs(self, pairs: Sequence[tuple[str, str]], metas: Sequence[Any] = ()) -> torch.Tensor:
        """One score per (query, doc) pair: the scheduler's batch mixes queries."""
        model = self._model
        if model is None:
            raise RuntimeError(f"rerank engine {self.name!r} is not running")
        pairs = [(q, d) for q, d in pairs]
        if not pairs:
            return torch.empty(0, dtype=torch.float32)
        check_text(pairs)
        async with self._limiter:
            start = time.monotonic()
            scores = await run_in_own_thread(self._predict, model, pairs)
            self._env.observe_batch("rerank", len(pairs), start, time.monotonic())
        return scores

    def _predict(self, model: Any, pairs: list[tuple[str, str]]) -> torch.Tensor:
        scores = model.predict(pairs, batch_size=self._batch_size, convert_to_tensor=True, show_progress_bar=False)
        # predict runs under inference_mode; clone so callers get an ordinary tensor.
        return scores.reshape(len(pairs)).to(device="cpu", dtype=torch.float32).clone()


# ----- LLM reranker --------------------------------------------------------------

SYSTEM_PROMPT = (
    "You judge whether a document is relevant to a search query. Answer with a single word: yes or no."
)

# The judge's first answer token may come capitalised or after a space
# (SmolLM2 favours "Yes"/"No"); pooling the variants with logsumexp scores the
# meaning, not the spelling.
YES_VARIANTS = ("yes", "Yes", " yes", " Yes")
NO_VARIANTS = ("no", "No", " no", " No")
# The defaults of the options max_doc_tokens and max_query_tokens: what of each text the judge reads.
MAX_DOC_TOKENS, MAX_QUERY_TOKENS = 384, 128


class LLMReranker:
    """A ``RerankEngine`` that asks an LLM engine a yes/no relevance question per document."""

    kind = "rerank"

    def __init__(self, spec: EngineSpec, env: EngineEnv) -> None:
        self.name = spec.name
        self._env = env
        self._llm_name = str(spec.options.get("llm") or "")
        if not self._llm_name:
            raise ValueError(f"engines.{spec.name}.options.llm is required: name the LLM engine that judges relevance.")
        self._max_doc_tokens = int(spec.options.get("max_doc_tokens", MAX_DOC_TOKENS))
        if self._max_doc_tokens < 1:
            raise ValueError(f"engines.{spec.name}.options.max_doc_tokens must be >= 1")
        self._max_query_tokens = int(spec.options.get("max_query_tokens", MAX_QUERY_TOKENS))
        if self._max_query_tokens < 1:
            raise ValueError(f"engines.{spec.name}.options.max_query_tokens must be >= 1")
        self._document_first = spec.options.get("document_first", True)
        if not isinstance(self._document_first, bool):
            raise ValueError(f"engines.{spec.name}.options.document_first must be true or false")
        self._llm: Any = None
        self._scorer: Any = None  # the LLM's scheduler in a daemon; the LLM itself on its own
        self._yes_ids: list[int] = []
        self._no_ids: list[int] = []

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            self._llm = self._find_llm()
            self._scorer = self._env.lookup_scheduled(self._llm_name) if self._env.lookup_scheduled else None
            self._yes_ids = single_token_ids(self._llm, YES_VARIANTS)
            self._no_ids = single_token_ids(self._llm, NO_VARIANTS)
            if not self._yes_ids or not self._no_ids or set(self._yes_ids) & set(self._no_ids):
                raise ValueError(
                    f"rerank engine {self.name!r}: LLM engine {self._llm_name!r} has no distinct single-token "
                    "'yes' and 'no' answers; use another LLM for llm-rerank"
                )
            task_status.started()
            await anyio.sleep_forever()
        finally:
            self._llm = self._scorer = None

    def _find_llm(self) -> Any:
        # The daemon's lookup raises LookupError for an unknown or not-yet-loaded
        # engine (engines load in config order, so the LLM must come first).
        try:
            llm = self._env.lookup(self._llm_name)
        except LookupError as exc:
            raise LookupError(
                f"engines.{self.name}.options.llm names {self._llm_name!r}, which is not a loaded engine "
                f"(configure it before {self.name!r}): {exc}"
            ) from exc
        if llm is None:
            raise LookupError(f"engines.{self.name}.options.llm names {self._llm_name!r}, but no such engine exists")
        if getattr(llm, "kind", None) != "llm" or not isinstance(llm, LLMEngine):
            raise TypeError(
                f"engines.{self.name}.options.llm names {self._llm_name!r}, which is a "
                f"{getattr(llm, 'kind', type(llm).__name__)!r} engine, not an LLM engine"
            )
        return llm

    async def score(self, query: str, docs: Sequence[str]) -> torch.Tensor:
        return await self.score_pairs([(query, doc) for doc in docs])

    async def score_pairs(self, pairs: Sequence[tuple[str, str]], metas: Sequence[Any] = ()) -> torch.Tensor:
        """One score per (query, doc) pair, all in one prefill-only LLM call, through the LLM's scheduler."""
        llm = self._llm
        if llm is None:
            raise RuntimeError(f"rerank engine {self.name!r} is not running")
        if not pairs:
            return torch.empty(0, dtype=torch.float32)
        check_text(pairs)
        start = time.monotonic()
        # Tokenizing thousands of documents takes a while: off the event loop.
        prompts = await anyio.to_thread.run_sync(self._prompts, llm, list(pairs))
        token_ids = self._yes_ids + self._no_ids
        if self._scorer is not None:
            logits = await self._scorer.next_token_logits(prompts, token_ids, metas, through_cache=self._document_first)
        elif self._document_first and isinstance(llm, ScoresThroughCache) and llm.scores_through_cache:
            logits, _ = await llm.next_token_logits_cached(prompts, token_ids)
        else:
            logits = await llm.next_token_logits(prompts, token_ids)
        self._env.observe_batch("rerank", len(pairs), start, time.monotonic())
        logits = logits.to(device="cpu", dtype=torch.float32)
        n_yes = len(self._yes_ids)
        margin = torch.logsumexp(logits[:, :n_yes], dim=1) - torch.logsumexp(logits[:, n_yes:], dim=1)
        return torch.sigmoid(margin)

    @property
    def warms_documents(self) -> bool:
        """``WarmsDocuments``: the document first, on a running LLM that scores through its (enabled) prefix cache."""
        llm = self._llm
        return (self._document_first and isinstance(llm, ScoresThroughCache) and llm.scores_through_cache
                and bool(getattr(llm, "prefix_caching_enabled", lambda: False)()))

    async def warm_documents(self, docs: Sequence[str], metas: Sequence[Any] = ()) -> int:
        """``WarmsDocuments``: each document scored once behind an empty query, so its prompt's system prompt and
        document are in the LLM's prefix cache (then its tiers) for the first query that retrieves it."""
        if not docs or not self.warms_documents:
            return 0
        await self.score_pairs([("", doc) for doc in docs], metas)
        return len(docs)

    def _messages(self, query: str, doc: str) -> list[dict[str, str]]:
        return judge_messages(query, doc, self._document_first)

    def _prompts(self, llm: Any, pairs: list[tuple[str, str]]) -> list[list[int]]:
        queries: dict[str, str] = {}  # a batch mostly repeats a few queries
        prompts = []
        for query, doc in pairs:
            if query not in queries:
                queries[query] = truncate_to_tokens(llm, query, self._max_query_tokens)
            doc = truncate_to_tokens(llm, doc, self._max_doc_tokens)
            prompts.append(llm.chat_tokens(self._messages(queries[query], doc)))
        return prompts


def judge_messages(query: str, doc: str, document_first: bool) -> list[dict[str, str]]:
    """The judge's chat for one (query, document) pair, in either order."""
    pair = f"Document: {doc}\nQuery: {query}\n" if document_first else f"Query: {query}\nDocument: {doc}\n"
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": pair + "Is the document relevant to the query? Answer yes or no."},
    ]


def check_text(pairs: Sequence[tuple[str, str]]) -> None:
    """Refuse text a tokenizer cannot take (lone surrogates) with a clear error, before any model work."""
    check_texts((query for query, _ in pairs), "the query of pair")
    check_texts((doc for _, doc in pairs), "the document of pair")


def single_token_ids(llm: Any, words: Sequence[str]) -> list[int]:
    """Token ids of those ``words`` that the LLM's tokenizer encodes as one token."""
    prefix = list(llm.encode(""))  # whatever encode prepends (a BOS, say)
    ids: list[int] = []
    for word in words:
        toks = list(llm.encode(word))
        if toks[: len(prefix)] == prefix:
            toks = toks[len(prefix) :]
        if len(toks) == 1 and toks[0] not in ids:
            ids.append(toks[0])
    return ids


def truncate_to_tokens(llm: Any, text: str, max_tokens: int) -> str:
    """The longest prefix of ``text`` (cut at a character) within ``max_tokens`` of ``llm.encode``."""
    steps = truncation(text, max_tokens)
    probe = next(steps)
    try:
        while True:
            probe = steps.send(len(llm.encode(probe)))
    except StopIteration as done:
        return done.value


def truncation(text: str, max_tokens: int) -> Generator[str, int, str]:
    """``truncate_to_tokens``'s search, for any tokenizer: it yields each text whose token count it needs and is
    sent that count back; it returns the cut text. (A client that tokenizes over HTTP drives it the same way.)

    The LLM protocol has no detokenizer, so cut characters instead: start from
    the proportional guess and shrink until the prefix fits.
    """
    n = yield text
    if n <= max_tokens:
        return text
    cut = len(text) * max_tokens // n
    while cut > 0:
        n = yield text[:cut]
        if n <= max_tokens:
            return text[:cut]
        cut = min(cut - 1, cut * max_tokens // n)
    return ""


# ----- registration ------------------------------------------------------------------


def cross_encoder_factory(spec: EngineSpec, env: EngineEnv) -> CrossEncoderReranker:
    return CrossEncoderReranker(spec, env)


def llm_rerank_factory(spec: EngineSpec, env: EngineEnv) -> LLMReranker:
    return LLMReranker(spec, env)


@hookimpl
def register_engines(register):
    register("cross-encoder", cross_encoder_factory)
    register("llm-rerank", llm_rerank_factory)
