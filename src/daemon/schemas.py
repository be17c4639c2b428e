"""Request and response bodies of the HTTP API, as pydantic models.

The request models are the single source of what a body may hold: the routes
validate with them and /openapi.json is generated from them. Pydantic (v2)
because it is maintained, already installed (lancedb depends on it), and gives
both a strict validator with field paths in its errors and the JSON Schema of
the same class, so the published schema cannot drift from the checks.

Request models are strict (no coercion: ``"1"`` is not an integer, ``true`` is
not a number) and closed (``extra="forbid"``: an unsupported parameter is
refused by name). Fields OpenAI's SDKs may send with their "off" value (``n``,
the penalties, ...) are declared with only that value allowed.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from headrace.plugins.protocols import SEED_MAX, SEED_MIN

# A sane ceiling; the model's context bounds what is really generated.
MAX_TOKENS_LIMIT = 2**31 - 1
TOKEN_ID_LIMIT = 2**63  # exclusive; the model's vocabulary is checked per engine

NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0, lt=TOKEN_ID_LIMIT)]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)]


class Body(BaseModel):
    """A request body: strict and closed."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


# Fields accepted only with the value that means "off" (what OpenAI's SDKs may send by default).
NEUTRAL = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0, "logprobs": False, "echo": False, "best_of": 1,
           "logit_bias": {}}


class NeutralFields(Body):
    n: Annotated[int, Field(ge=1, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=0, le=0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=0, le=0)] | None = None
    logprobs: Literal[False] | None = None
    logit_bias: Annotated[dict[str, float], Field(max_length=0)] | None = None


class Sampling(Body):
    temperature: Annotated[float, Field(ge=0, le=2)] | None = Field(None, description="0 means greedy; default 1")
    top_p: Annotated[float, Field(gt=0, le=1)] | None = Field(None, description="default 1")
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: str | Annotated[list[NonEmptyStr], Field(max_length=4)] | None = Field(
        None, description="a string (empty: none) or at most 4 non-empty strings")
    stream: bool | None = None
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    user: str | None = None


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


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(None, description="required, except in an assistant message "
                                                                   "that carries tool_calls")
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="assistant messages: the calls it made")
    tool_call_id: str | None = Field(None, description="tool messages: the call this is the result of")


class ChatCompletionRequest(Sampling, NeutralFields, WithResponseFormat):
    model: NonEmptyStr
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    tools: Annotated[list[Tool], Field(min_length=1, max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: auto with tools, none without")
    parallel_tool_calls: bool | None = Field(None, description="default true: the model may call several tools")


class CompletionRequest(Sampling, NeutralFields, WithResponseFormat):
    model: NonEmptyStr
    prompt: (NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=1)]
             | Annotated[list[TokenId], Field(min_length=1)]) = Field(
        description="a string, a list of one string, or a list of token ids")
    max_tokens: MaxTokens | None = Field(None, description="default 16")
    echo: Literal[False] | None = None
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None


class EmbeddingRequest(Body):
    model: NonEmptyStr
    input: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] = Field(
        description="a string or a list of strings (token arrays are not supported)")
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


class RunRequest(Body):
    """A workflow run; ``inputs`` and ``config`` are validated against the workflow's own schemas."""

    inputs: dict[str, Any] | None = None
    config: dict[str, Any] | None = None
    stream: bool | None = Field(None, description="send the run's events as server-sent events")
    background: bool | None = Field(None, description="answer 202 at once; the run goes on without the client")


COLLECTION_NAME = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"  # headrace.graph.collections.NAME


class CreateCollectionRequest(Body):
    name: str = Field(pattern=COLLECTION_NAME, description="1-64 letters, digits, '_' or '-', starting with a "
                                                           "letter or digit")
    embedding_model: NonEmptyStr | None = Field(None, description="an embed engine; default: the first one")
    vector_store: NonEmptyStr | None = Field(None, description="a vector-store engine; default: the first one")
    chunk_size: Annotated[int, Field(ge=16, le=1024)] = Field(256, description="words per chunk")
    chunk_overlap: Annotated[int, Field(ge=0, le=1023)] = Field(30, description="words shared by neighbours; "
                                                                                "less than chunk_size")


class CollectionDocument(Body):
    # No control characters: an id is a file path or a key, and ends up in URLs and logs.
    id: str | None = Field(None, pattern=r"^[^\x00-\x1f\x7f]{1,256}$",
                           description="re-posting an id replaces that document; default: a new id")
    text: NonEmptyStr
    metadata: dict[str, Any] | None = Field(None, description="kept with each of the document's chunks")


class AddDocumentsRequest(Body):
    documents: Annotated[list[CollectionDocument], Field(min_length=1, max_length=1000)]


Sampling.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()


# Responses: documented in /openapi.json; the routes build them as plain dicts. ----------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    status: str
    version: str


class Readiness(BaseModel):
    ready: bool
    engines: dict[str, dict[str, Any]]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    kind: str
    plugin: str
    ready: bool


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TextChoice(BaseModel):
    index: int
    text: str
    logprobs: None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage


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


class CollectionCard(BaseModel):
    id: str
    object: Literal["collection"]
    embedding_model: str
    vector_store: str
    chunk_size: int
    chunk_overlap: int
    created: int
    documents: int
    chunks: int
    ann_index: bool = Field(description="vector search uses an ANN index (from collections.ann_index_rows chunks)")


class CollectionList(BaseModel):
    object: Literal["list"]
    data: list[CollectionCard]


class DocumentsAdded(BaseModel):
    object: Literal["collection.documents"]
    collection: str
    ids: list[str] = Field(description="the documents' ids, in request order")
    chunks: int = Field(description="chunks the documents made")


class EngineSettingsRequest(Body):
    llm_policy: NonEmptyStr | None = Field(None, description="an LLM engine's scheduling policy from now on "
                                                              "(fifo, topology, objective, or a plugin's)")
    prefix_caching: bool | None = Field(None, description="an LLM engine's automatic prefix caching; false drops "
                                                           "what it holds")


class EngineSettings(BaseModel):
    id: str
    object: Literal["engine.settings"]
    kind: str
    llm_policy: str | None = Field(description="LLM engines: the scheduling policy in force")
    prefix_caching: bool | None = Field(description="LLM engines with a prefix cache: whether it is on")


class Deleted(BaseModel):
    id: str
    object: str
    deleted: bool


class WorkflowList(BaseModel):
    object: Literal["list"]
    data: list[dict[str, Any]] = Field(description="each workflow's name, description and JSON schemas")


class RunRecord(BaseModel):
    id: str
    object: Literal["workflow.run"]
    workflow: str
    status: str
    result: Any
    error: str | None
    created: int
    seconds: float
    nodes: list[dict[str, Any]]
    passes: list[dict[str, Any]]


class RunGraph(BaseModel):
    run: str
    graph: dict[str, Any]
    dot: str


class RunTimeline(BaseModel):
    run: str
    workflow: str
    status: str
    seconds: float
    nodes: list[dict[str, Any]]
    engines: list[dict[str, Any]]
