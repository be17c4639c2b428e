"""headrace's own request and response bodies, as pydantic models: workflow runs, collections,
semantic-variable sessions, engine settings and the probes.

Strict and closed as OpenAI's (``openai_schemas.Body``): the routes validate with them and
/openapi.json is generated from them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from headrace.daemon.openai_schemas import Body, MaxTokens, NonEmptyStr
from headrace.graph.graph import LLM_MAX_TOKENS
from headrace.plugins.protocols import SEED_MAX, SEED_MIN


class RunRequest(Body):
    """A workflow run; ``inputs`` and ``config`` are validated against the workflow's own schemas."""

    inputs: dict[str, Any] | None = None
    config: dict[str, Any] | None = None
    stream: bool | None = Field(None, description="send the run's events as server-sent events")
    background: bool | None = Field(None, description="answer 202 at once; the run goes on without the client")


COLLECTION_NAME = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"  # headrace.graph.collection_refs.NAME


class CreateCollectionRequest(Body):
    name: str = Field(pattern=COLLECTION_NAME, description="1-64 letters, digits, '_' or '-', starting with a "
                                                           "letter or digit")
    embedding_model: NonEmptyStr | None = Field(None, description="an embed engine; default: the first one")
    vector_store: NonEmptyStr | None = Field(None, description="a vector-store engine; default: the first one")
    chunk_size: Annotated[int, Field(ge=16, le=1024)] = Field(256, description="words per chunk")
    chunk_overlap: Annotated[int, Field(ge=0, le=1023)] = Field(30, description="words shared by neighbours; "
                                                                                "less than chunk_size")
    chunk_kv: bool = Field(True, description="prefill each chunk's KV when it is ingested, behind the RAG "
                                             "workflows' chunk-first prompts, so a first retrieval is a cache hit")


class CollectionDocument(Body):
    # No control characters: an id is a file path or a key, and ends up in URLs and logs.
    id: str | None = Field(None, pattern=r"^[^\x00-\x1f\x7f]{1,256}$",
                           description="re-posting an id replaces that document; default: a new id")
    text: NonEmptyStr
    metadata: dict[str, Any] | None = Field(None, description="kept with each of the document's chunks")


class AddDocumentsRequest(Body):
    documents: Annotated[list[CollectionDocument], Field(min_length=1, max_length=1000)]


# Semantic-variable sessions (Parrot) ------------------------------------------------------

VARIABLE_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,63}$"  # what a {{input:x}} / {{output:y}} placeholder can name
VariableName = Annotated[str, Field(pattern=VARIABLE_NAME)]


class CreateSessionRequest(Body):
    """A new session (no settings yet: the body may be empty); it expires after sessions.idle_seconds idle."""


class CreateVariableRequest(Body):
    name: VariableName = Field(description="letters, digits and '_', not starting with a digit")
    value: str | None = Field(None, description="its content now; else set it later (once) with PUT, or bind it "
                                                "as a call's output")


class SetVariableRequest(Body):
    value: str = Field(description="the variable's content; a variable is set once")


class OutputSampling(Body):
    max_tokens: MaxTokens = Field(LLM_MAX_TOKENS, description="tokens this output may generate")
    temperature: Annotated[float, Field(ge=0, le=2)] = Field(0.0, description="0 (the default) means greedy")
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: Annotated[list[NonEmptyStr], Field(max_length=4)] = Field([], description="at most 4 stop strings")


class SemanticCallRequest(Body):
    template: NonEmptyStr = Field(description="a prompt with {{input:x}} and {{output:y}} placeholders anywhere; "
                                              "each output is generated from the text before it, earlier outputs "
                                              "filled in")
    outputs: dict[VariableName, OutputSampling] = Field(
        {}, description="sampling per output variable; an output not named here gets the defaults")
    model: NonEmptyStr | None = Field(None, description="an LLM engine; default: the first ready one")
    system: str | None = Field(None, description="a system message framing every output's prompt")


# Responses: documented in /openapi.json; the routes build them as plain dicts. ----------


class Health(BaseModel):
    status: str
    version: str


class Readiness(BaseModel):
    ready: bool
    engines: dict[str, dict[str, Any]]


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
    max_runs: Annotated[int, Field(ge=0)] | None = Field(
        None, description="an LLM engine's bound on runs served at once from now on (0: none); waiting runs are "
                          "let in by the LLM policy's rank")
    retention: bool | None = Field(None, description="an LLM engine with prefix-cache pins: whether a named program's "
                                                     "context stays pinned across its tool calls (false: plain LRU "
                                                     "for programs; cache_control marks still pin)")
    prefix_cache_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None, description="an LLM engine with a prefix cache: its budget in tokens from now on, emptied (a "
                          "benchmark's memory pressure); its pins keep their share of it unless "
                          "prefix_cache_pin_tokens is given too")
    prefix_cache_pin_tokens: Annotated[int, Field(ge=0)] | None = Field(
        None, description="an LLM engine with prefix-cache pins: what pins may hold at most, in tokens, up to the "
                          "prefix cache's budget; the cache is emptied")


class EngineSettings(BaseModel):
    id: str
    object: Literal["engine.settings"]
    kind: str
    llm_policy: str | None = Field(description="LLM engines: the scheduling policy in force")
    prefix_caching: bool | None = Field(description="LLM engines with a prefix cache: whether it is on")
    max_runs: int | None = Field(description="LLM engines: runs served at once (0: no bound)")
    retention: bool | None = Field(description="LLM engines with prefix-cache pins: whether programs' contexts are "
                                               "retained across tool calls")
    prefix_cache_tokens: int | None = Field(None, description="LLM engines with a prefix cache: its budget in tokens")
    prefix_cache_pin_tokens: int | None = Field(None, description="LLM engines with a prefix cache: what its pins may "
                                                                  "hold at most, in tokens")


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
    details_dropped: bool = Field(description="past [workflows] run_history_mib: its graph, events, passes and "
                                  "piece timings are gone (the graph and events routes answer 410), its summary and "
                                  "nodes kept")


class Query(BaseModel):
    """Query parameters: closed like a body, but lax, since every value arrives as a string ("20")."""

    model_config = ConfigDict(extra="forbid")


class RunListQuery(Query):
    limit: Annotated[int, Field(ge=1, le=100)] = Field(20, description="runs per page")
    order: Literal["asc", "desc"] = Field("desc", description="by creation: newest first (desc) or oldest first")
    after: NonEmptyStr | None = Field(None, description="the last_id of the previous page: list the runs after it")


class RunEventsQuery(Query):
    after: Annotated[int, Field(ge=-1)] | None = Field(
        None, description="the id of the last event already read: follow from the next one (default: the oldest the "
                          "run still holds; the Last-Event-ID header says the same)")


class RunList(BaseModel):
    """One page of the caller's runs, in OpenAI's list shape."""

    object: Literal["list"]
    data: list[RunRecord]
    first_id: str | None
    last_id: str | None
    has_more: bool


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


class VariableQuery(Query):
    criteria: Literal["latency", "throughput"] | None = Field(
        None, description="what the client waits for: latency marks the variable's producer (and the calls "
                          "right before it) latency-critical; throughput lets its producers batch")
    timeout: Annotated[float, Field(ge=0, le=600)] = Field(60.0, description="seconds to wait for the value; "
                                                                             "then 408")


class SessionVariable(BaseModel):
    object: Literal["session.variable"]
    name: str
    state: Literal["pending", "ready", "failed"]
    value: str | None = Field(description="the content, once ready")
    error: str | None = Field(description="why its producer failed")
    producer: str | None = Field(description="the call that writes it; null: the client sets it")
    criteria: Literal["latency", "throughput"] | None


class SessionCall(BaseModel):
    id: str
    object: Literal["session.call"]
    status: Literal["waiting", "running", "succeeded", "failed", "cancelled"]
    inputs: list[str]
    outputs: list[str]
    objective: Literal["latency", "throughput"] = Field(description="the deduced objective its primitives are "
                                                                    "scheduled for, as of now")
    error: str | None
    created: int


class SessionCard(BaseModel):
    id: str
    object: Literal["session"]
    created: int
    idle_seconds: float = Field(description="closed after this long with no request on it")
    variables: list[SessionVariable]
    calls: list[SessionCall]
