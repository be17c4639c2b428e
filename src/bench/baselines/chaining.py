"""map_reduce_summary and chain_summary chained by a client with the openai SDK (Parrot's baseline).

The client does what headrace's graph does server-side: it chunks the document, sends
one ``/v1/chat/completions`` request per LLM call and builds each next prompt itself
from the answers it got back. Independent calls are dispatched concurrently (the map
calls, and the reduce calls of one level), as Parrot's baseline does; dependent ones
wait for their inputs, so every step of the chain is a round trip.

Each request is one user message holding exactly the text headrace renders for that
call (``PromptTemplate(...).render``, the same templates imported from
src/graph/workflows/summary.py), with temperature 0 and the workflow's max_tokens;
answers are stripped as headrace strips a decode's text. Config keys, defaults and
validation are headrace's own (its workflow schemas). Nothing is retried
(``max_retries=0``): a failure surfaces instead of being re-sent silently.
"""

from __future__ import annotations

import asyncio
from typing import Any

from headrace.bench.baselines import client_validate, require
from headrace.graph.ops import chunk_text
from headrace.graph.prompts import PromptTemplate
from headrace.graph.workflow import Workflow
from headrace.graph.workflows import summary
from headrace.graph.workflows.common import count_chunks

WHAT = "the client-chaining baseline"
WORKFLOWS: dict[str, Workflow] = {"map_reduce_summary": summary.MAP_REDUCE, "chain_summary": summary.CHAIN}

MAP = PromptTemplate(summary.MAP)
FIRST = PromptTemplate(summary.FIRST)
UPDATE = PromptTemplate(summary.UPDATE)


def reduce_template(n: int) -> PromptTemplate:
    """The reduce prompt over ``n`` partial summaries, built as summary.build_map_reduce builds it."""
    body = "".join(f"Part {j + 1}: {{{{input:part_{j}}}}}\n" for j in range(n))
    return PromptTemplate(summary.REDUCE_HEAD + body + "Summary: {{output:summary}}")


def validate(workflow: str, inputs: Any, config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """headrace's own validation and defaults, and the same errors for a bad split."""
    inputs, config = client_validate(WHAT, WORKFLOWS, workflow, inputs, config)
    count_chunks(inputs, "document", config)  # the same errors for a bad split
    return inputs, config


class ClientChaining:
    """Summaries chained by the client over the daemon's chat completions.

    ``base_url`` is the daemon's root URL (``http://127.0.0.1:8000``; one ending in
    ``/v1`` is accepted too) and ``llm`` the model id. One instance serves any number of
    concurrent runs on one event loop; ``aclose()`` (or ``async with``) releases its
    connections.
    """

    def __init__(self, base_url: str, api_key: str, llm: str, *, timeout: float = 600.0,
                 http_client: Any = None) -> None:
        self._openai = require("openai", "openai", WHAT)  # MissingPeer here, not halfway through a benchmark
        root = base_url.rstrip("/")
        root = root[: -len("/v1")] if root.endswith("/v1") else root
        self.api_base = root + "/v1"
        self.api_key = api_key
        self.llm = llm
        self.timeout = timeout
        self.http_client = http_client  # an httpx.AsyncClient for the SDK (the caller closes it), or the SDK's own
        self._client: Any = None  # made on first use, in the loop that uses it

    def client(self) -> Any:
        if self._client is None:
            self._client = self._openai.AsyncOpenAI(base_url=self.api_base, api_key=self.api_key or "unused",
                                                    max_retries=0, timeout=self.timeout,
                                                    http_client=self.http_client)
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            if self.http_client is None:  # the SDK's own client; a caller's is the caller's to close
                await self._client.close()
            self._client = None

    async def __aenter__(self) -> "ClientChaining":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def complete(self, prompt: str, max_tokens: int) -> str:
        """One call: the rendered prompt as one user message; the answer stripped, as headrace's."""
        response = await self.client().chat.completions.create(
            model=self.llm, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=max_tokens)
        return (response.choices[0].message.content or "").strip()

    async def run(self, workflow: str, inputs: dict, config: dict) -> dict:
        """Run ``workflow`` ("map_reduce_summary" or "chain_summary") on ``inputs`` = {document}."""
        inputs, config = validate(workflow, inputs, config)
        chunks = chunk_text(inputs["document"], config["chunk_size"], config["chunk_overlap"])
        if workflow == "map_reduce_summary":
            return {"summary": await self._map_reduce(chunks, config)}
        return {"summary": await self._chain(chunks, config)}

    async def _map_reduce(self, chunks: list[str], config: dict[str, Any]) -> str:
        max_tokens, fan_in = config["max_tokens"], config["fan_in"]
        level = list(await asyncio.gather(*(self.complete(MAP.render({"chunk": c}), max_tokens) for c in chunks)))
        while len(level) > 1:  # fan_in partial summaries per call, level by level
            groups = [level[i : i + fan_in] for i in range(0, len(level), fan_in)]
            prompts = [reduce_template(len(g)).render({f"part_{j}": s for j, s in enumerate(g)}) for g in groups]
            level = list(await asyncio.gather(*(self.complete(p, max_tokens) for p in prompts)))
        return level[0]

    async def _chain(self, chunks: list[str], config: dict[str, Any]) -> str:
        max_tokens = config["max_tokens"]
        text = await self.complete(FIRST.render({"chunk": chunks[0]}), max_tokens)
        for c in chunks[1:]:
            text = await self.complete(UPDATE.render({"previous": text, "chunk": c}), max_tokens)
        return text


__all__ = ["ClientChaining", "reduce_template", "validate"]
