"""What the LLM engine tests share: running an engine on its own event loop, and reading its streams."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import time
from contextlib import aclosing
from pathlib import Path
from typing import Any, Iterator

import anyio
from anyio.from_thread import start_blocking_portal

from headrace.plugins.api import EngineError

LONG_ENOUGH = 600.0  # seconds: the slowest engine's first batches on a busy machine
CONTRIB = Path(__file__).resolve().parents[2] / "plugins-contrib"


def contrib_module(name: str, directory: str):
    """A contrib plugin's package: the installed one, else the source tree's (not installed here)."""
    if name in sys.modules:
        return sys.modules[name]
    if importlib.util.find_spec(name) is not None:
        return importlib.import_module(name)
    package = CONTRIB / directory / name
    spec = importlib.util.spec_from_file_location(name, package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class Batches(list):
    """The engine's batch observations as (op, size), as the daemon's metrics receive them."""

    def __call__(self, op: str, size: int, start: float, end: float) -> None:
        assert end >= start
        self.append((op, size))


@contextlib.contextmanager
def running(engine: Any) -> Iterator[Any]:
    """The engine running on its own event loop in a thread; tests call into it through the portal."""
    with start_blocking_portal() as portal:
        future, _ = portal.start_task(engine.run)
        try:
            yield portal
        finally:
            future.cancel()


async def collect(deltas) -> tuple[str, list[int], str | None]:
    """A stream's (text, token ids, finish reason)."""
    text, ids, finish = "", [], None
    with anyio.fail_after(LONG_ENOUGH):
        async with aclosing(deltas) as stream:
            async for delta in stream:
                text += delta.text
                ids += delta.token_ids
                finish = delta.finish_reason
    return text, ids, finish


async def text_of(stream) -> tuple[str, str | None, int]:
    """A stream's (text, finish reason, token count)."""
    text, ids, finish = await collect(stream)
    return text, finish, len(ids)


async def outcome(stream):
    """The stream's (text, finish, tokens), or the error that ended it."""
    try:
        return await text_of(stream)
    except EngineError as exc:
        return exc


def chat(engine, content: str) -> list[int]:
    return engine.chat_tokens([{"role": "user", "content": content}])


async def wait_for_no_contexts(engine, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while engine.stats()["contexts"] and time.monotonic() < deadline:
        await anyio.sleep(0.02)
    return engine.stats()


def check_daemon_chat_and_context_limit(server: Any, model: str) -> None:
    """A daemon on the engine answers a chat, and refuses a prompt over the context with OpenAI's 400."""
    import httpx

    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=LONG_ENOUGH, headers=headers, json={
        "model": model, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "What colour is the sky?"}],
    })
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] <= 8
    too_long = httpx.post(f"{server.base_url}/v1/completions", timeout=LONG_ENOUGH, headers=headers, json={
        "model": model, "max_tokens": 4, "prompt": [42] * 5000,
    })
    assert too_long.status_code == 400, too_long.text
    assert too_long.json()["error"]["code"] == "context_length_exceeded"


async def outcomes(engine, prompts: dict, params) -> dict:
    """Generate from every prompt (key -> tokens) at once: each one's outcome, by key."""
    out: dict = {}

    async def one(key, tokens):
        out[key] = await outcome(engine.generate(tokens, params))

    async with anyio.create_task_group() as tg:
        for key, tokens in prompts.items():
            tg.start_soon(one, key, tokens)
    return out
