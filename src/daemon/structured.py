"""Structured output and tool calling for the OpenAI routes.

``response_format`` and a required tool call become an ``OutputConstraint`` that every LLM
engine enforces by constrained decoding; ``tools`` are rendered by the engine's chat
template (``headrace.plugins.engines.llm.chat``), and the output is parsed back into OpenAI's
``tool_calls``. A response is a tool call when it begins with ``<tool_call>``; each complete
block is one call (so a stream sends each call as soon as its block closes). A block that
``max_tokens`` cut off is still a call, as OpenAI's API answers it: its name and the arguments
so far (not JSON yet), with ``finish_reason: "length"``; the template's markup never becomes content.

``tool_choice``: ``none`` offers no tools; ``auto`` offers them and decodes freely (a small
model may answer in text, or write a call, which is parsed); ``required`` and a named
function constrain the output to calls of the allowed tools whose arguments match their
``parameters`` schemas (several calls when ``parallel_tool_calls`` is not false).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from headrace.daemon.errors import bad_request
from headrace.daemon.openai_schemas import (ChatCompletionRequest, CompletionRequest, JsonObjectFormat,
                                            JsonSchemaFormat, TokenizeChatRequest)
from headrace.plugins.engines.llm import constraints
from headrace.plugins.engines.llm.chat import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from headrace.plugins.protocols import JsonSchemaConstraint, LarkConstraint, OutputConstraint

# What llguidance writes: JSON with these separators and no free whitespace (constraints.JSON_OPTIONS).
X_GUIDANCE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def schema_chars(body: ChatCompletionRequest | CompletionRequest) -> int:
    """About how large the request's schemas are (what compiling them costs)."""
    fmt = body.response_format
    size = len(compact(fmt.json_schema.schema_)) if isinstance(fmt, JsonSchemaFormat) else 0
    if isinstance(body, ChatCompletionRequest):
        size += sum(len(compact(tool.function.parameters or {})) for tool in body.tools or ())
    return size


def _checked(constraint: OutputConstraint, param: str) -> OutputConstraint:
    try:
        constraints.check(constraint)
    except constraints.ConstraintError as exc:
        raise bad_request(f"'{param}' cannot be enforced: {exc}", param=param, code="invalid_schema") from None
    return constraint


def response_constraint(body: ChatCompletionRequest | CompletionRequest) -> JsonSchemaConstraint | None:
    """The constraint ``response_format`` asks for (None for text); a schema that cannot be compiled is a 400."""
    fmt = body.response_format
    if isinstance(fmt, JsonObjectFormat):
        return JsonSchemaConstraint(compact({"type": "object"}))
    if isinstance(fmt, JsonSchemaFormat):
        schema = fmt.json_schema.schema_
        constraint = JsonSchemaConstraint(compact(schema if schema is not None else {"type": "object"}))
        return _checked(constraint, "response_format")  # type: ignore[return-value]
    return None


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools."""

    specs: list[dict[str, Any]]  # the tools the prompt offers, as OpenAI tool objects
    names: frozenset[str]
    constraint: LarkConstraint | None  # required or named: the output must be calls


def plan_tools(body: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tool use; None when it offers no tools (none given, or ``tool_choice: none``)."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' is only allowed when 'tools' are given", param="tool_choice")
        return None
    if choice == "none":
        return None
    if body.response_format is not None and body.response_format.type != "text":
        raise bad_request("'response_format' cannot be combined with 'tools' (the answer is either a JSON value "
                          "or tool calls)", param="response_format")
    tools = {t.function.name: t for t in body.tools}
    if len(tools) < len(body.tools):
        raise bad_request("two tools have the same name", param="tools")
    specs = [t.model_dump(exclude_none=True, by_alias=True) for t in body.tools]
    if choice in (None, "auto"):
        return ToolPlan(specs, frozenset(tools), None)
    if choice == "required":
        allowed, several = list(tools), body.parallel_tool_calls is not False
    else:
        if choice.function.name not in tools:
            raise bad_request(f"'tool_choice' names the function '{choice.function.name}', which is not in 'tools'",
                              param="tool_choice")
        allowed, several = [choice.function.name], False
    for i, t in enumerate(body.tools):  # name the faulty tool's schema rather than the combined grammar
        if t.function.name in allowed:
            _checked(JsonSchemaConstraint(compact(_call_schema([t]))), f"tools[{i}].function.parameters")
    grammar = _calls_grammar(_call_schema([tools[n] for n in allowed]), several)
    return ToolPlan(specs, frozenset(tools), _checked(LarkConstraint(grammar), "tools"))  # type: ignore[arg-type]


def _call_schema(tools: list[Any]) -> dict[str, Any]:
    """One call to any of ``tools``: {"name": <its name>, "arguments": <its parameters>}.

    Each tool's ``$defs`` move to the root, where its ``#/$defs/...`` references point.
    """
    defs: dict[str, Any] = {}
    options = []
    for t in tools:
        params = constraints.closed_objects(dict(t.function.parameters or NO_ARGUMENTS))
        for key in ("$defs", "definitions"):
            if key in params:
                defs.update(params.pop(key))
        options.append({"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**schema, "x-guidance": X_GUIDANCE}
    if defs:
        schema["$defs"] = defs
    return schema


def _calls_grammar(schema: dict[str, Any], several: bool) -> str:
    """Lark (llguidance's dialect): one or more ``<tool_call>`` blocks, each a JSON call matching ``schema``."""
    repeat = ' ("\\n" call)*' if several else ""
    return (f"start: call{repeat}\n"
            f'call: "{TOOL_CALL_OPEN}\\n" body "\\n{TOOL_CALL_CLOSE}"\n'
            f"body: %json {json.dumps(schema, ensure_ascii=False)}\n")


# ----- parsing the output --------------------------------------------------------------------


def _call(block: str, names: frozenset[str]) -> dict[str, Any] | None:
    """One ``<tool_call>`` block's JSON as an OpenAI tool call; None when it is not a call to a known tool."""
    try:
        data = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or data.get("name") not in names:
        return None
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string already
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return _tool_call(data["name"], json.dumps(arguments, ensure_ascii=False))


def _tool_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


# The head of a call block as the template (and the constraint's grammar) writes it: its name, maybe cut.
_CUT_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)("?)')
_ARGUMENTS = re.compile(r'\s*,\s*"arguments"\s*:\s*')


def _cut_call(block: str, names: frozenset[str]) -> dict[str, Any] | None:
    """The call a block cut off by ``max_tokens`` began: its name (a cut name: the one tool it can begin) and
    its arguments as far as they came; None when it names no tool (or several could be meant)."""
    for k in range(len(TOOL_CALL_CLOSE), 0, -1):  # a closing tag begun: the JSON before it is whole
        if block.endswith("\n" + TOOL_CALL_CLOSE[:k]):
            block = block[: -k - 1]
            break
    whole = _call(block.strip(), names)  # cut after the JSON, before the closing tag
    if whole is not None:
        return whole
    head = _CUT_NAME.match(block)
    if head is None:
        return None
    name, closed = head.group(1), head.group(2)
    if not closed:
        candidates = [n for n in names if n.startswith(name)]
        return _tool_call(candidates[0], "") if len(candidates) == 1 else None
    if name not in names:
        return None
    arguments = _ARGUMENTS.match(block, head.end())
    return _tool_call(name, block[arguments.end():] if arguments else "")


@dataclass
class ToolCallParser:
    """Splits a generation into content text and tool calls as it streams.

    ``feed`` returns what can be sent now: ("content", text) and ("call", tool_call) items.
    Text that could still open a call is held back; a block that is not a valid call is content.
    """

    names: frozenset[str]
    calls: list[dict[str, Any]] = field(default_factory=list)
    cut: bool = False  # the last call is one max_tokens cut off (finish(cut=True) found it)
    _buffer: str = ""
    _mode: str = "start"  # start: nothing decided yet; calls: inside the leading calls; text: plain content

    def feed(self, text: str) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        self._buffer += text
        while True:
            if self._mode == "text":
                if self._buffer:
                    out.append(("content", self._buffer))
                    self._buffer = ""
                return out
            head = self._buffer.lstrip()
            if not head or (TOOL_CALL_OPEN.startswith(head) and self._mode == "start"):
                return out  # undecided: wait for more
            if self._mode == "calls" and TOOL_CALL_OPEN.startswith(head):
                return out
            if not head.startswith(TOOL_CALL_OPEN):
                self._mode = "text"
                continue
            end = head.find(TOOL_CALL_CLOSE)
            if end < 0:
                return out  # inside a block
            call = _call(head[len(TOOL_CALL_OPEN):end].strip(), self.names)
            block, self._buffer = head[: end + len(TOOL_CALL_CLOSE)], head[end + len(TOOL_CALL_CLOSE):]
            if call is None:
                out.append(("content", block))
                self._mode = "text"
                continue
            self.calls.append(call)
            out.append(("call", call))
            self._mode = "calls"

    def finish(self, cut: bool = False) -> list[tuple[str, Any]]:
        """The rest. ``cut`` (the generation reached max_tokens): a block it cut off is a call with the
        arguments so far, and markup too short to name a tool is dropped; else such a block is content."""
        rest, self._buffer = self._buffer, ""
        head = rest.lstrip()
        if cut and self._mode != "text" and head:
            if head.startswith(TOOL_CALL_OPEN):
                call = _cut_call(head[len(TOOL_CALL_OPEN):], self.names)
                if call is None:
                    return []
                self.calls.append(call)
                self.cut = True
                return [("call", call)]
            if TOOL_CALL_OPEN.startswith(head):
                return []
        if self._mode == "calls":
            rest = rest.strip()
        return [("content", rest)] if rest else []


def parse_tool_output(text: str, names: frozenset[str], cut: bool = False) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a whole generation; content is None when it holds only calls. ``cut``: it
    reached max_tokens (a call it cut off is a call, see ``ToolCallParser.finish``)."""
    parser = ToolCallParser(names)
    items = parser.feed(text) + parser.finish(cut)
    content = "".join(value for kind, value in items if kind == "content")
    return (content or None) if parser.calls else content, parser.calls


def chat_messages(body: ChatCompletionRequest | TokenizeChatRequest) -> list[dict[str, Any]]:
    """The messages in Hugging Face's chat format (what the engines' chat templates take)."""
    out: list[dict[str, Any]] = []
    for j, m in enumerate(body.messages):
        role = "system" if m.role == "developer" else m.role
        if m.tool_calls is not None and m.role != "assistant":
            raise bad_request("only assistant messages carry 'tool_calls'", param=f"messages[{j}].tool_calls")
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise bad_request("a message needs 'content' (only an assistant message with 'tool_calls' may omit it)",
                              param=f"messages[{j}].content", code="missing_required_parameter")
        message: dict[str, Any] = {"role": role, "content": _text(m.content)}
        if m.role == "tool":
            if not m.tool_call_id:
                raise bad_request("a tool message needs 'tool_call_id'", param=f"messages[{j}].tool_call_id",
                                  code="missing_required_parameter")
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            message["tool_calls"] = [_history_call(c, f"messages[{j}].tool_calls[{i}]")
                                     for i, c in enumerate(m.tool_calls)]
        out.append(message)
    return out


def _history_call(c: Any, param: str) -> dict[str, Any]:
    try:
        arguments = json.loads(c.function.arguments) if c.function.arguments.strip() else {}
    except json.JSONDecodeError:
        raise bad_request("a tool call's 'arguments' is not JSON", param=f"{param}.function.arguments") from None
    return {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": arguments}}


def _text(content: Any) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(part.text for part in content)
