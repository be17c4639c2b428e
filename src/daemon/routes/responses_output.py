"""A Responses answer's output items, built as the generation streams, and the semantic events that tell them.

The text is split by chat's tool-call parser (``structured.ToolCallParser``): content becomes a ``message``
item of ``output_text``, each call a ``function_call`` item. A call ``max_output_tokens`` cut off is
still a ``function_call`` item (``status: "incomplete"``, its arguments so far), as is the message it
cut (``incomplete``); the response is then ``incomplete`` with ``incomplete_details.reason``
``max_output_tokens``. Events carry no ``sequence_number``: the SSE framing numbers them.
"""

from __future__ import annotations

import uuid
from typing import Any

from headrace.daemon import structured


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Output:
    def __init__(self, tools: structured.ToolPlan | None) -> None:
        self.parser = structured.ToolCallParser(tools.names) if tools is not None else None
        self.items: list[dict[str, Any]] = []
        self.status = "in_progress"
        self._message: dict[str, Any] | None = None  # the message item being written
        self._text: list[str] = []

    def feed(self, text: str, finish: str | None) -> list[dict[str, Any]]:
        """The events this piece of the generation makes (``finish``: it is the last piece)."""
        cut = finish == "length"
        if self.parser is None:
            pieces = [("content", text)] if text else []
        else:
            pieces = self.parser.feed(text) + (self.parser.finish(cut) if finish else [])
        events: list[dict[str, Any]] = []
        for kind, value in pieces:
            if kind == "content":
                events += self._content(value)
            else:
                events += self._close_message("completed")
                last = finish is not None and self.parser is not None and self.parser.cut and value is self.parser.calls[-1]
                events += self._call(value, "incomplete" if last else "completed")
        if finish:
            if not self.items and self._message is None:
                events += self._content("")  # an empty answer is still one (empty) message
            events += self._close_message("incomplete" if cut else "completed")
            self.status = "incomplete" if cut else "completed"
        return events

    def _content(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._message is None:
            self._message = {"id": _id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                             "content": []}
            self._text = []
            events += [{"type": "response.output_item.added", "output_index": len(self.items),
                        "item": dict(self._message)},
                       {"type": "response.content_part.added", "item_id": self._message["id"],
                        "output_index": len(self.items), "content_index": 0, "part": _part("")}]
        if text:
            self._text.append(text)
            events.append({"type": "response.output_text.delta", "item_id": self._message["id"],
                           "output_index": len(self.items), "content_index": 0, "delta": text, "logprobs": []})
        return events

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        if self._message is None:
            return []
        text, index, item_id = "".join(self._text), len(self.items), self._message["id"]
        item = {**self._message, "status": status, "content": [_part(text)]}
        self.items.append(item)
        self._message = None
        return [{"type": "response.output_text.done", "item_id": item_id, "output_index": index, "content_index": 0,
                 "text": text, "logprobs": []},
                {"type": "response.content_part.done", "item_id": item_id, "output_index": index, "content_index": 0,
                 "part": _part(text)},
                {"type": "response.output_item.done", "output_index": index, "item": item}]

    def _call(self, call: dict[str, Any], status: str) -> list[dict[str, Any]]:
        index, function = len(self.items), call["function"]
        item = {"id": _id("fc"), "type": "function_call", "status": status, "call_id": call["id"],
                "name": function["name"], "arguments": function["arguments"]}
        self.items.append(item)
        # A call is sent once its block is complete (or cut): its arguments in one delta.
        return [{"type": "response.output_item.added", "output_index": index,
                 "item": {**item, "status": "in_progress", "arguments": ""}},
                {"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": index,
                 "delta": item["arguments"]},
                {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
                 "name": item["name"], "arguments": item["arguments"]},
                {"type": "response.output_item.done", "output_index": index, "item": item}]


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
