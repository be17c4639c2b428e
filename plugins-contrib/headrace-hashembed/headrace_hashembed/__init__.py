"""headrace-hashembed: a feature-hashing embedder, as a pip-installable plugin.

headrace finds this module through the ``headrace`` entry-point group and calls
its ``register_engines`` hook.
"""

from __future__ import annotations

import time
import zlib
from typing import Any, Sequence

import anyio
import torch

from headrace.plugins.hookspecs import hookimpl
from headrace.plugins.api import EngineEnv, EngineSpec

__all__ = ["HashEmbedder", "factory", "register_engines", "trigrams"]


def trigrams(text: str) -> list[str]:
    """Lowercase character trigrams, padded with a space so short words count too."""
    padded = f" {text.lower()} "
    return [padded[i : i + 3] for i in range(len(padded) - 2)] if text.strip() else []


class HashEmbedder:
    """An ``EmbedEngine`` hashing trigrams into ``dimensions`` signed buckets.

    crc32, unlike ``hash()``, is not salted per process, so vectors stay
    comparable across restarts. A sign bit per trigram keeps collisions from
    piling up in one direction.
    """

    kind = "embed"

    def __init__(self, spec: EngineSpec, env: EngineEnv) -> None:
        self.name = spec.name
        self._env = env
        self.dimensions = int(spec.options.get("dimensions", 64))
        if self.dimensions < 1:
            raise ValueError(f"engines.{spec.name}.options.dimensions must be >= 1")

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()  # nothing to load
        await anyio.sleep_forever()

    def count_tokens(self, texts: Sequence[str]) -> int:
        return sum(len(trigrams(t)) for t in texts)

    async def embed(self, texts: Sequence[str]) -> torch.Tensor:
        texts = list(texts)
        start = time.monotonic()
        vectors = await anyio.to_thread.run_sync(self._embed, texts)
        if texts:
            self._env.observe_batch("embed", len(texts), start, time.monotonic())
        return vectors

    def _embed(self, texts: list[str]) -> torch.Tensor:
        out = torch.zeros((len(texts), self.dimensions), dtype=torch.float32)
        for row, text in enumerate(texts):
            for gram in trigrams(text):
                h = zlib.crc32(gram.encode("utf-8"))
                out[row, h % self.dimensions] += 1.0 if h & 0x80000000 else -1.0
        # An empty text stays the zero vector rather than dividing by zero.
        return torch.nn.functional.normalize(out, dim=1)


def factory(spec: EngineSpec, env: EngineEnv) -> HashEmbedder:
    return HashEmbedder(spec, env)


@hookimpl
def register_engines(register):
    register("hash-embed", factory)
