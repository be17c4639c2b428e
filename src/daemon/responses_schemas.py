"""OpenAI's Responses API bodies (``POST /v1/responses``), as pydantic models: strict and closed like
``openai_schemas.Body``, so a field this server does not serve is refused by name.

The request is served as a chat request (``routes.responses_api`` maps it onto ``ChatCompletionRequest``),
so what a field means is what it means on chat. Fields OpenAI's SDKs and the Agents SDK send that change
nothing for this server's models (``reasoning``, ``service_tier``, ``safety_identifier``, ``text.verbosity``,
``truncation: "disabled"``, ``include`` of reasoning content there is none of) are accepted and ignored;
one that would change the output and is not served (``background``, ``conversation``, ``prompt``,
images and files in the input, logprobs) stays a named 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, create_model

from headrace.daemon.headrace_schemas import Query
from headrace.daemon.openai_schemas import FUNCTION_NAME, Body, CacheSalt, MaxTokens, NonEmptyStr, Sampling

MAX_TOOLS = 128
MAX_METADATA = 16  # OpenAI's: at most 16 pairs, keys up to 64 characters, values up to 512


# Input items ----------------------------------------------------------------------------


class InputText(Body):
    type: Literal["input_text"]
    text: str


class OutputText(Body):
    """An earlier answer's text, sent back as it came (the Agents SDK sends whole output items)."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class Refusal(Body):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[InputText | OutputText | Refusal, Field(discriminator="type")]


class MessageItem(Body):
    """A message: OpenAI's easy form (``type`` left out, ``content`` a string) or the full one."""

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Annotated[list[ContentPart], Field(min_length=1)]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(Body):
    """A call an earlier answer made (its result follows as a ``function_call_output`` with the same call_id)."""

    type: Literal["function_call"]
    call_id: NonEmptyStr
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str = Field(description="the arguments as a JSON text")
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: NonEmptyStr = Field(description="the function_call this is the result of (earlier in the conversation)")
    output: str | Annotated[list[InputText], Field(min_length=1)]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


# Tags capitalised, so an error's field path (bodies.param_of) leaves them out: input[0].content, not
# input[0].message.content.
ITEM_TAGS = {"message": "Message", "function_call": "FunctionCall", "function_call_output": "FunctionCallOutput"}


def _item_type(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None) or "message"
    return ITEM_TAGS.get(kind, kind) if isinstance(kind, str) else repr(kind)


InputItem = Annotated[Annotated[MessageItem, Tag("Message")] | Annotated[FunctionCallItem, Tag("FunctionCall")]
                      | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")], Discriminator(_item_type)]


# Tools and the output format -------------------------------------------------------------


class FunctionTool(Body):
    """A function tool in the Responses API's flat shape (chat nests it under ``function``)."""

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of the arguments object")
    strict: bool | None = Field(None, description="accepted; a constrained call always matches the parameters")


class FunctionToolChoice(Body):
    type: Literal["function"]
    name: NonEmptyStr


class TextFormatText(Body):
    type: Literal["text"]


class TextFormatJsonObject(Body):
    type: Literal["json_object"]


class TextFormatJsonSchema(Body):
    """Chat's ``response_format: json_schema``, flat: enforced by the same constrained decoding."""

    type: Literal["json_schema"]
    name: str = Field(pattern=FUNCTION_NAME)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = Field(None, description="accepted; the output always matches the schema")


class TextConfig(Body):
    format: Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema,
                      Field(discriminator="type")] | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="accepted and ignored")


class Reasoning(Body):
    """Accepted and ignored: the models served here do not reason apart from their answer."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponseStreamOptions(Body):
    include_obfuscation: bool | None = Field(None, description="accepted; no obfuscation field is sent")


# The peers' sampling fields (issue 43, part 3), as chat defines them (same names, ranges and descriptions):
# routes.responses_api passes them to the chat request the response is served as.
PEER_SAMPLING = ("presence_penalty", "frequency_penalty", "repetition_penalty", "top_k", "min_p", "logit_bias",
                 "min_tokens", "ignore_eos", "stop_token_ids")
PeerSampling = create_model("PeerSampling", __base__=Body,  # type: ignore[call-overload]
                            **{name: (Sampling.model_fields[name].annotation, Sampling.model_fields[name])
                               for name in PEER_SAMPLING})


class ResponseRequest(PeerSampling):
    model: NonEmptyStr
    input: NonEmptyStr | Annotated[list[InputItem], Field(min_length=1)] = Field(
        description="a user message's text, or a list of items: messages, function_call, function_call_output")
    instructions: str | None = Field(None, description="a system message first; not carried over from "
                                                       "previous_response_id")
    previous_response_id: NonEmptyStr | None = Field(
        None, description="continue that stored response: its conversation is rebuilt server-side and the turn "
                          "joins its program (its earlier tokens are found in the prefix cache)")
    tools: Annotated[list[FunctionTool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = Field(
        None, description="default: auto with tools")
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    store: bool | None = Field(None, description="default true: kept for GET and previous_response_id "
                                                 "([responses] max_age_seconds)")
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=MAX_METADATA)] | None = None
    stream: bool | None = None
    stream_options: ResponseStreamOptions | None = None
    user: str | None = Field(None, description="names the program when prompt_cache_key does not")
    prompt_cache_key: str | None = Field(None, description="the program a first turn joins (a continued turn "
                                                           "joins its predecessor's)")
    cache_salt: CacheSalt | None = None  # this request's own: a continued turn does not inherit its predecessor's
    include: list[Literal["reasoning.encrypted_content"]] | None = Field(None, description="accepted: there is no "
                                                                                           "reasoning content")
    # Accepted, changing nothing here (as vLLM accepts them).
    reasoning: Reasoning | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    safety_identifier: str | None = None
    truncation: Literal["disabled"] | None = None
    background: Literal[False] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=0)] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None


class InputItemsQuery(Query):
    """``GET /v1/responses/{id}/input_items``'s query (lax like the run list's: values arrive as strings)."""

    limit: Annotated[int, Field(ge=1, le=100)] = Field(20, description="items per page")
    order: Literal["asc", "desc"] = Field("desc", description="oldest first (asc) or newest first (desc, OpenAI's "
                                                              "default)")
    after: NonEmptyStr | None = Field(None, description="the last_id of the previous page")


ResponseRequest.model_rebuild()


# What the routes answer (documented in /openapi.json; built as plain dicts) ---------------------


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="input tokens found in the prefix cache, not prefilled")


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str = Field(description="resp_...")
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete"]
    model: str
    output: list[dict[str, Any]] = Field(description="message items (output_text parts) and function_call items")
    incomplete_details: IncompleteDetails | None
    error: None
    instructions: str | None
    previous_response_id: str | None
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    max_output_tokens: int | None
    metadata: dict[str, str]
    store: bool
    text: dict[str, Any]
    usage: ResponseUsage


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


class InputItemList(BaseModel):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
