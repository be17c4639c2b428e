"""Chat prompts with tools, shared by every engine that applies a Hugging Face chat template.

A template that renders tools itself (its source mentions ``tools``, as Qwen's, Hermes' and
Llama 3's do) gets them through ``apply_chat_template(tools=...)``. Otherwise (SmolLM2's
template knows only roles and content) the tools are described in the system message, in the
Hermes format those models were tuned on: a ``<tools>`` list, and calls written as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks. The daemon parses that
same format out of the output, and constrains it when a call is required.

Messages are Hugging Face's chat format (what templates take): ``role`` and ``content``; an
assistant's ``tool_calls`` as ``[{"type": "function", "function": {"name", "arguments"}}]``
with ``arguments`` a mapping; a ``tool`` message's ``tool_call_id``.

The template is the model's (its GGUF's or its tokenizer's), or the engine's ``chat_template``
option (a Jinja file or an inline Jinja string, :func:`read_template`), which the engine sets on
the tokenizer. A model with neither has no chat format: :class:`NoChatTemplate` says which option
to set (the routes answer it with a 400). A template writes its own BOS (``{{ bos_token }}``) and
the ids are the rendered text's, with no special tokens added on top: one BOS, never two.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"

ChatMessages = Sequence[Mapping[str, Any]]
ToolSpecs = Sequence[Mapping[str, Any]]  # OpenAI's tool objects: {"type": "function", "function": {...}}


class NoChatTemplate(ValueError):
    """The model has no chat template and none is configured: a chat prompt cannot be made."""

    def __init__(self, engine: str) -> None:
        super().__init__(f"engine {engine!r} serves a model without a chat template, so it takes no chat messages: "
                         f"set engines.{engine}.options.chat_template (a Jinja file or an inline Jinja string), "
                         "or send a plain prompt to /v1/completions")
        self.engine = engine


def read_template(value: Any, key: str) -> str | None:
    """The ``chat_template`` option's Jinja source: inline (it has Jinja markup, ``{{`` or ``{%``) or a file's;
    None when unset. Read when the config loads, so a missing file is a config error."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{key}: must be a path to a Jinja file or an inline Jinja string, not {value!r}")
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"{key}: {path} is not a file (an inline template has Jinja markup: {{{{ or {{%)")
    return path.read_text(encoding="utf-8")


# The tokens that close a turn in the chat formats in use (from llama.cpp's end-of-generation list).
TURN_ENDS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<|eom_id|>", "<|END_OF_TURN_TOKEN|>")


def turn_end_ids(tokenizer: Any) -> set[int]:
    """The special tokens that end a turn in the tokenizer's chat template: an answer ends there whatever the
    model's EOS is (Gemma 3's GGUF and generation config name only ``<eos>``; its turns end with
    ``<end_of_turn>``, as llama.cpp's end-of-generation tokens and the instruct model's own config say)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return set()
    ids = set()
    for marker in TURN_ENDS:
        if marker in template:
            token = tokenizer.convert_tokens_to_ids(marker)
            if isinstance(token, int) and token != tokenizer.unk_token_id \
                    and tokenizer.convert_ids_to_tokens(token) == marker:
                ids.add(token)
    return ids


def has_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def template_renders_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in template


def tools_system_prompt(tools: ToolSpecs) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You can call functions. These are their signatures:\n<tools>\n" + listed + "\n</tools>\n"
            "To call a function, answer with a JSON object with its name and arguments inside "
            f"{TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} tags, one block per call:\n"
            f'{TOOL_CALL_OPEN}\n{{"name": "<function-name>", "arguments": <arguments-object>}}\n{TOOL_CALL_CLOSE}')


def format_tool_call(name: str, arguments: Any) -> str:
    """One call as the model writes it (and as the constraint grammar spells it)."""
    return f"{TOOL_CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"


def _plain(messages: ChatMessages, tools: ToolSpecs | None) -> list[dict[str, Any]]:
    """Messages for a template without tool support: tools in the system message, calls and results as text."""
    out: list[dict[str, Any]] = []
    for m in messages:
        content = m.get("content") or ""
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(format_tool_call(c["function"]["name"], c["function"]["arguments"])
                              for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{calls}".lstrip("\n")})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": content})
    if tools:
        prompt = tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def apply_template(tokenizer: Any, messages: ChatMessages, tools: ToolSpecs | None, tokenize: bool,
                   add_generation_prompt: bool = True) -> Any:
    """The chat template applied, ready for the assistant's turn (unless ``add_generation_prompt`` is false);
    token ids (a list) or the text. ``tokenizer.apply_chat_template`` adds no special tokens to the rendered
    text, so the template's own BOS is the only one."""
    if template_renders_tools(tokenizer):
        out = tokenizer.apply_chat_template([dict(m) for m in messages], tools=list(tools) if tools else None,
                                            add_generation_prompt=add_generation_prompt, tokenize=tokenize)
    else:
        out = tokenizer.apply_chat_template(_plain(messages, tools), add_generation_prompt=add_generation_prompt,
                                            tokenize=tokenize)
    if not tokenize:
        return out
    return list(out["input_ids"] if hasattr(out, "keys") else out)
