"""OpenAI's request and response bodies, as pydantic models (and the OpenAI-compatible servers'
extensions headrace serves the same way: vLLM's /tokenize and /detokenize, and /v1/rerank).

The request models are the single source of what a body may hold: the routes
validate with them and /openapi.json is generated from them. Pydantic (v2)
because it is maintained, already installed (lancedb depends on it), and gives
both a strict validator with field paths in its errors and the JSON Schema of
the same class, so the published schema cannot drift from the checks.

Request models are strict (no coercion: ``"1"`` is not an integer, ``true`` is
not a number) and closed (``extra="forbid"``: an unsupported parameter is
refused by name). Fields OpenAI's SDKs may send with their "off" value (``best_of``)
are declared with only that value allowed; fields that change nothing
here (``service_tier``, ``reasoning_effort``, ...) are accepted and ignored, as vLLM
ignores them. headrace's own
routes (runs, collections, sessions, engine settings, probes) have theirs in
``headrace_schemas``, built on the same ``Body``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from headrace.plugins.protocols import MAX_TOP_LOGPROBS, SEED_MAX, SEED_MIN


# /v1/completions without max_tokens generates 16 tokens: OpenAI's documented default, an API contract
# (chat has none; headrace uses DEFAULT_MAX_TOKENS there).
COMPLETIONS_MAX_TOKENS = 16

# A sane ceiling; the model's context bounds what is really generated.
MAX_TOKENS_LIMIT = 2**31 - 1
TOKEN_ID_LIMIT = 2**63  # exclusive; the model's vocabulary is checked per engine

NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0, lt=TOKEN_ID_LIMIT)]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)]
# /v1/completions: 0 with echo scores the prompt and generates nothing (what lm-eval's loglikelihood may send).
CompletionMaxTokens = Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)]


MAX_CACHE_SALT = 256  # characters of a cache_salt


def _cache_salt(salt: str) -> str:
    # vLLM's CVE-2026-105756 was a crash on a bad salt: every bad one is a 400 here (bodies names its code).
    if not salt:
        raise ValueError("must be a non-empty string")
    if len(salt) > MAX_CACHE_SALT:
        raise ValueError(f"must be at most {MAX_CACHE_SALT} characters, not {len(salt)}")
    if not salt.isprintable():
        raise ValueError("must hold printable characters only (no control characters, tabs or line breaks)")
    return salt


CacheSalt = Annotated[str, AfterValidator(_cache_salt), Field(
    description="vLLM's cache_salt: only requests with the same salt (and, where the daemon keeps API keys apart, "
                f"the same key) reuse each other's cached KV. 1 to {MAX_CACHE_SALT} printable characters")]


class Body(BaseModel):
    """A request body: strict and closed."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


# Fields accepted only with the value that means "off" (what OpenAI's SDKs may send by default).
NEUTRAL = {"best_of": 1}
# Choices one request may ask for, over all its prompts (each is a decode the engine batches).
MAX_CHOICES = 128
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
PROMPT_LOGPROBS = (f"vLLM's: each prompt token's log-probability given the tokens before it, with the k (0 to "
                   f"{MAX_TOP_LOGPROBS}) most likely tokens there; not with stream")
Penalty = Annotated[float, Field(ge=-2, le=2)]
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,20}$")]  # a token id as a JSON object's key (logit_bias)


class NeutralFields(Body):
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = Field(
        None, description=f"choices per prompt (default 1; at most {MAX_CHOICES} over all prompts); the prompt is "
                          "prefilled once and forked")


class Sampling(Body):
    temperature: Annotated[float, Field(ge=0, le=2)] | None = Field(None, description="0 means greedy; default 1")
    top_p: Annotated[float, Field(gt=0, le=1)] | None = Field(None, description="default 1")
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: str | Annotated[list[NonEmptyStr], Field(max_length=4)] | None = Field(
        None, description="a string (empty: none) or at most 4 non-empty strings")
    stream: bool | None = None
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    user: str | None = Field(None, description="the end user; names the request's program when "
                                               "prompt_cache_key does not")
    prompt_cache_key: str | None = Field(
        None, description="the program (an agent's or a conversation's turns) the request joins: the `las` LLM "
                          "policy ranks it by the tokens that program was served so far, and a turn that ends in "
                          "tool calls keeps its context's KV pinned for the program's next turn")
    cache_salt: CacheSalt | None = None
    # OpenAI's penalties and logit_bias, and vLLM's extensions (its SamplingParams' names and ranges).
    presence_penalty: Penalty | None = Field(None, description="subtracted once from the logit of every token "
                                                               "generated so far; default 0")
    frequency_penalty: Penalty | None = Field(None, description="subtracted from the logit of every token generated "
                                                                "so far, times its count; default 0")
    repetition_penalty: Annotated[float, Field(gt=0)] | None = Field(
        None, description="tokens of the prompt and the output: a positive logit divided by it, a negative one "
                          "multiplied (vLLM's); default 1 (off)")
    top_k: Annotated[int, Field(ge=-1)] | None = Field(None, description="sample among the k most likely tokens; "
                                                                         "0 or -1 (the default): all")
    min_p: Annotated[float, Field(ge=0, le=1)] | None = Field(
        None, description="drop tokens less likely than min_p times the most likely one; default 0 (off)")
    logit_bias: dict[TokenIdKey, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, description="token ids of the model's tokenizer (as strings) to a bias from -100 to 100 added to "
                          "their logits; -100 bans a token")
    min_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)] | None = Field(
        None, description="no end (EOS, stop_token_ids, stop strings) before this many tokens; at most max_tokens "
                          "(which, not given, is raised to it)")
    ignore_eos: bool | None = Field(None, description="EOS does not end the output (it runs to max_tokens)")
    stop_token_ids: list[TokenId] | None = Field(None, description="generating one of these ends the output (it "
                                                                   "counts as a token, but is not in the text)")


class StreamOptions(Body):
    include_usage: bool = False


# Structured output (response_format) ------------------------------------------------------

FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function and schema names


class TextFormat(Body):
    type: Literal["text"]


class JsonObjectFormat(Body):
    type: Literal["json_object"]


class JsonSchemaSpec(Body):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON Schema; absent: any JSON object")
    strict: bool | None = Field(None, description="accepted; the output always matches the schema")


class JsonSchemaFormat(Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class WithResponseFormat(Body):
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object, or json_schema: enforced by constrained decoding")


# Tools ----------------------------------------------------------------------------------


class FunctionDefinition(Body):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of the arguments object; absent: "
                                                                "no arguments")
    strict: bool | None = Field(None, description="accepted; a constrained call always matches the parameters")


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Body):
    name: NonEmptyStr


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(Body):
    name: NonEmptyStr
    arguments: str = Field(description="the arguments as a JSON text")


class ToolCall(Body):
    id: NonEmptyStr
    type: Literal["function"]
    function: ToolCallFunction


# A cache_control mark's TTL: Anthropic's two names, or seconds; at most an hour (Anthropic's longest).
CACHE_TTL_NAMES = {"5m": 300.0, "1h": 3600.0}
MAX_CACHE_TTL_SECONDS = 3600.0


def cache_ttl_seconds(ttl: str | int | float | None) -> float:
    """A checked mark's TTL in seconds (none given: 5 minutes, Anthropic's default)."""
    if ttl is None:
        return CACHE_TTL_NAMES["5m"]
    return CACHE_TTL_NAMES[ttl] if isinstance(ttl, str) else float(ttl)


class CacheControl(Body):
    """Anthropic's (and LiteLLM's) prompt-caching mark: the prompt up to and including the message it is on
    is pinned in the prefix cache for ``ttl``."""

    type: Literal["ephemeral"]
    ttl: str | int | float | None = Field(None, description="'5m' (the default), '1h', or seconds from 1 to 3600")

    @field_validator("ttl")
    @classmethod
    def _ttl(cls, ttl: str | int | float | None) -> str | int | float | None:
        if isinstance(ttl, str) and ttl not in CACHE_TTL_NAMES:
            raise ValueError(f"must be '5m', '1h' or a number of seconds, not {ttl!r}")
        if isinstance(ttl, (int, float)) and not 1 <= ttl <= MAX_CACHE_TTL_SECONDS:
            raise ValueError(f"must be from 1 to {MAX_CACHE_TTL_SECONDS:.0f} seconds, not {ttl!r}")
        return ttl


class TextPart(Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(None, description="required, except in an assistant message "
                                                                   "that carries tool_calls")
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="assistant messages: the calls it made")
    tool_call_id: str | None = Field(None, description="tool messages: the call this is the result of")
    cache_control: CacheControl | None = Field(None, description="pin the prompt up to and including this message "
                                                                 "in the prefix cache")


class PredictionContent(Body):
    type: Literal["content"]
    content: str | list[TextPart]


class IgnoredFields(Body):
    """Fields OpenAI's clients send that change nothing here: accepted and ignored (vLLM ignores them too)."""

    service_tier: str | None = Field(None, description="accepted and ignored: one tier serves every request")
    reasoning_effort: str | None = Field(None, description="accepted and ignored: the models here do not reason")
    verbosity: str | None = Field(None, description="accepted and ignored")
    safety_identifier: str | None = Field(None, description="accepted and ignored")
    prediction: PredictionContent | None = Field(None, description="accepted and ignored (a predicted output "
                                                                   "only speeds a response up)")


class ChatCompletionRequest(Sampling, NeutralFields, WithResponseFormat, IgnoredFields):
    model: NonEmptyStr
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = Field(None, description="each output token's log-probability in choices[].logprobs")
    top_logprobs: TopLogprobs | None = Field(None, description="with logprobs: true, the k most likely tokens "
                                                               "at each position")
    metadata: dict[str, str] | None = Field(None, description="accepted and ignored")
    store: bool | None = Field(None, description="accepted and ignored: chat completions are not stored")
    tools: Annotated[list[Tool], Field(min_length=1, max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: auto with tools, none without")
    parallel_tool_calls: bool | None = Field(None, description="default true: the model may call several tools")
    prompt_logprobs: TopLogprobs | None = Field(None, description=PROMPT_LOGPROBS + " (in the response's "
                                                                  "prompt_logprobs)")


class CompletionRequest(Sampling, NeutralFields, WithResponseFormat):
    model: NonEmptyStr
    prompt: (NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_CHOICES)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_CHOICES)]) = Field(
        description="a string, a list of strings, a list of token ids, or a list of token-id lists; "
                    "each prompt gets n choices, numbered prompt * n + sample")
    max_tokens: CompletionMaxTokens | None = Field(
        None, description=f"default {COMPLETIONS_MAX_TOKENS}; 0 only with echo: the prompt is scored, nothing "
                          "generated")
    max_completion_tokens: CompletionMaxTokens | None = Field(None, description="an alias of max_tokens (it wins "
                                                                                "over it)")
    logprobs: TopLogprobs | None = Field(None, description="each output token's log-probability and the k most "
                                                           "likely tokens at each position (with echo, the "
                                                           "prompt's tokens first; the first one's is null)")
    echo: bool | None = Field(None, description="the choice's text starts with the prompt (a token-id prompt "
                                                "decoded), and its logprobs with the prompt's tokens")
    prompt_logprobs: TopLogprobs | None = Field(None, description=PROMPT_LOGPROBS + " (in each choice's "
                                                                  "prompt_logprobs)")
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None


class TokenizeRequest(Body):
    """vLLM's /tokenize of a text (``TokenizeCompletionRequest``)."""

    model: NonEmptyStr
    prompt: str
    add_special_tokens: bool = Field(True, description="the tokenizer's special tokens (e.g. BOS), as vLLM's default")
    return_token_strs: bool = Field(False, description="also the tokens as strings")


class TokenizeChatRequest(Body):
    """vLLM's /tokenize of chat messages through the model's chat template (``TokenizeChatRequest``)."""

    model: NonEmptyStr
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = Field(True, description="end with the assistant turn's header")
    return_token_strs: bool = Field(False, description="also the tokens as strings")


class DetokenizeRequest(Body):
    model: NonEmptyStr
    tokens: Annotated[list[TokenId], Field(min_length=1)]


class EmbeddingRequest(Body):
    model: NonEmptyStr
    input: (NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)]
            | Annotated[list[TokenId], Field(min_length=1)]
            | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]) = Field(
        description="a string, a list of strings, or token ids (a list, or a list of lists) of the embedding "
                    "model's own tokenizer, decoded with it as vLLM does (not tiktoken's)")
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[int, Field(ge=1)] | None = Field(None, description="must equal the model's; "
                                                                           "it cannot be reduced")
    user: str | None = None


class RerankDocument(Body):
    text: NonEmptyStr


class RerankRequest(Body):
    model: NonEmptyStr
    query: NonEmptyStr
    documents: Annotated[list[NonEmptyStr | RerankDocument], Field(min_length=1)] = Field(
        description="at most server.max_rerank_documents")
    top_n: Annotated[int, Field(ge=1)] | None = None
    return_documents: bool | None = None


Sampling.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()
TokenizeChatRequest.model_rebuild()


# Responses: documented in /openapi.json; the routes build them as plain dicts. ----------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ModelResidency(BaseModel):
    """Whether the model is loaded now, under the ``[residency]`` memory budget."""

    state: Literal["unloaded", "loading", "resident", "unloading"]
    pinned: bool  # never unloaded
    footprint_bytes: int | None  # measured at its last load; null before the first
    footprint_source: Literal["engine", "rss"] | None  # the engine's tensor bytes, or the process's RSS growth
    loads: int
    load_seconds: float | None  # its last load's


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    kind: str
    plugin: str
    ready: bool
    residency: ModelResidency


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens the engine's prefix cache served (0 from an engine that "
                                           "does not say; with n > 1, the choices' own prefills only)")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(BaseModel):
    """vLLM's ``Logprob``: one token of a prompt position's ``prompt_logprobs`` entry."""

    logprob: float
    rank: int = Field(description="how many tokens are at least as likely there, itself included (vLLM's count)")
    decoded_token: str


# One entry per prompt token: null for the first, else the actual token and the k most likely, by token id.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = Field(description="the token's UTF-8 bytes")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(description="the top_logprobs most likely tokens at this position")


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = Field(description="with logprobs: true")
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = Field(None, description="with prompt_logprobs: k (vLLM's)")


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] = Field(description="the k most likely tokens at each position, "
                                                                    "and the sampled one")
    text_offset: list[int] = Field(description="where each token starts in the choice's text")


class TextChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = Field(description="with logprobs: k")
    finish_reason: Literal["stop", "length"] | None
    prompt_logprobs: PromptLogprobs | None = Field(None, description="with prompt_logprobs: k")


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage


class Tokenized(BaseModel):
    count: int
    max_model_len: int = Field(description="the most tokens the model's context holds")
    tokens: list[int]
    token_strs: list[str] | None = None


class Detokenized(BaseModel):
    prompt: str


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 of little-endian float32")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
