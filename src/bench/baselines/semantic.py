"""map_reduce_summary and chain_summary submitted by a client as semantic calls (Parrot's API).

The same work as the client-chaining baseline (``chaining.py``), but the client never
waits between calls: it opens a session, creates one variable per chunk, submits every
call at once (each bound to the variables it reads and writes), then awaits the final
summary with ``criteria=latency``; the daemon chains the calls server-side as their inputs
are set. Prompts are the workflows' own templates with their placeholders renamed to the
session's variables, so each call renders exactly the text headrace's workflow (and the
chaining baseline) sends; greedy, with the workflow's max_tokens. The session is deleted
at the end, whatever happens.
"""

from __future__ import annotations

from typing import Any

import httpx

from headrace.bench.baselines.chaining import validate
from headrace.graph.ops import chunk_text
from headrace.graph.workflows import summary


def renamed(template: str, names: dict[str, str]) -> str:
    """``template`` with its placeholders' variables renamed (``{{input:chunk}}`` -> ``{{input:chunk_3}}``)."""
    for old, new in names.items():
        template = template.replace(f"{{{{input:{old}}}}}", f"{{{{input:{new}}}}}")
        template = template.replace(f"{{{{output:{old}}}}}", f"{{{{output:{new}}}}}")
    return template


class SemanticCalls:
    """Summaries as one session of semantic calls against the daemon at ``base_url`` (its root, or ``.../v1``)."""

    def __init__(self, base_url: str, api_key: str, llm: str, *, timeout: float = 600.0) -> None:
        root = base_url.rstrip("/")
        self.api_base = root if root.endswith("/v1") else root + "/v1"
        self.llm = llm
        self.timeout = timeout
        headers = {"Authorization": f"Bearer {api_key}"} if api_key and api_key != "none" else {}
        self._http = httpx.AsyncClient(base_url=self.api_base, headers=headers, timeout=timeout)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "SemanticCalls":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = await self._http.post(path, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"POST {path}: {r.status_code} {r.text[:300]}")
        return r.json()

    async def run(self, workflow: str, inputs: dict, config: dict) -> dict:
        """Run ``workflow`` ("map_reduce_summary" or "chain_summary") on ``inputs`` = {document}."""
        inputs, config = validate(workflow, inputs, config)
        chunks = chunk_text(inputs["document"], config["chunk_size"], config["chunk_overlap"])
        session = (await self._post("/sessions", {}))["id"]
        try:
            for i, text in enumerate(chunks):
                await self._post(f"/sessions/{session}/variables", {"name": f"chunk_{i}", "value": text})
            sampling = {"max_tokens": config["max_tokens"], "temperature": 0.0}
            if workflow == "map_reduce_summary":
                final = await self._map_reduce(session, len(chunks), config["fan_in"], sampling)
            else:
                final = await self._chain(session, len(chunks), sampling)
            r = await self._http.get(f"/sessions/{session}/variables/{final}",
                                     params={"criteria": "latency", "timeout": self.timeout})
            if r.status_code != 200:
                raise RuntimeError(f"the summary {final!r}: {r.status_code} {r.text[:300]}")
            return {"summary": r.json()["value"]}
        finally:
            await self._http.delete(f"/sessions/{session}")

    async def _call(self, session: str, template: str, output: str, sampling: dict[str, Any]) -> None:
        await self._post(f"/sessions/{session}/calls",
                         {"template": template, "model": self.llm, "outputs": {output: sampling}})

    async def _map_reduce(self, session: str, n: int, fan_in: int, sampling: dict[str, Any]) -> str:
        level = []
        for i in range(n):
            await self._call(session, renamed(summary.MAP, {"chunk": f"chunk_{i}", "summary": f"map_{i}"}),
                             f"map_{i}", sampling)
            level.append(f"map_{i}")
        depth = 0
        while len(level) > 1:  # fan_in partial summaries per call, level by level, as the workflow reduces
            groups = [level[i : i + fan_in] for i in range(0, len(level), fan_in)]
            level = []
            for g, group in enumerate(groups):
                out = f"reduce_{depth}_{g}"
                body = "".join(f"Part {j + 1}: {{{{input:{name}}}}}\n" for j, name in enumerate(group))
                await self._call(session, summary.REDUCE_HEAD + body + f"Summary: {{{{output:{out}}}}}", out,
                                 sampling)
                level.append(out)
            depth += 1
        return level[0]

    async def _chain(self, session: str, n: int, sampling: dict[str, Any]) -> str:
        await self._call(session, renamed(summary.FIRST, {"chunk": "chunk_0", "summary": "step_0"}), "step_0",
                         sampling)
        for i in range(1, n):
            names = {"previous": f"step_{i - 1}", "chunk": f"chunk_{i}", "summary": f"step_{i}"}
            await self._call(session, renamed(summary.UPDATE, names), f"step_{i}", sampling)
        return f"step_{n - 1}"


__all__ = ["SemanticCalls", "renamed"]
