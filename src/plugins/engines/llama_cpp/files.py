"""The llama-cpp engine's library and files: the bindings (loaded on first use, logging routed
to the daemon's logger), the model converted once to a faster quantization, and the model's HF
tokenizer read from the GGUF once. The engine itself is in ``engine``."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np

from headrace.plugins.engines.kvreuse.kv_store import payload_buffer
from headrace.plugins.engines.llama_cpp.cpu import (ProbeModel, chosen_variant, cpu_backend_loaded, library_dir,
                                                    load_variant)
from headrace.plugins.engines.models.loading import gguf_cache_key, has_tokenizer, made_once, tokenizer_cache_dir

log = logging.getLogger("headrace.plugins.engines.llama_cpp")  # llama.cpp's own log, at debug level

# The quantization types `quantize` accepts (llama_ftype values), and "none": use the file as it is.
QUANT_TYPES = {
    "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_M": 17,
    "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30,
}


# ----- llama.cpp, loaded on first use ----------------------------------------------------

_llama: Any = None


def llama(probe_model: ProbeModel | None = None) -> Any:
    """The ``llama_cpp.llama_cpp`` bindings, on the CPU backend this machine runs (``cpu``: the
    first call chooses it, proving it with ``probe_model`` in a child process), logging routed to ``log``."""
    global _llama
    if _llama is None:
        try:
            from llama_cpp import llama_cpp as bindings
        except ImportError as exc:
            raise RuntimeError(
                "the llama-cpp engine needs llama-cpp-python: run scripts/setup, which builds it "
                "(scripts/build-llama-cpp: about 9 minutes on 2 cores)"
            ) from exc
        lib_dir = library_dir()
        if not cpu_backend_loaded(lib_dir):  # a CPU backend is loaded once per process
            cache = probe_model.cache_dir if probe_model else default_cache_dir()
            load_variant(lib_dir, chosen_variant(lib_dir, probe_model, cache))
        bindings.llama_backend_init()
        bindings.llama_log_set(_log_callback, ctypes.c_void_p(0))
        _llama = bindings
    return _llama


def default_cache_dir() -> Path:
    """[data] cache_dir's default, for a caller that has no config (the daemon passes its own)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "headrace"


_capture = threading.local()  # a thread's (pattern, list): numbers its llama.cpp log lines say, while it asks


def capture_log_lines(pattern: re.Pattern[str] | None, into: list[float]) -> None:
    """From now on (until called with None), the first group of ``pattern`` in each llama.cpp log line this thread
    causes goes to ``into`` as a number (``lazy_kv`` reads the KV buffers' sizes so)."""
    _capture.wanted = (pattern, into) if pattern is not None else None


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _log_callback(level: int, text: bytes, user_data: Any) -> None:
    # llama.cpp logs a lot at every load; it is the daemon's debug output, never its stderr.
    # Module-level, so the callback outlives every engine (llama.cpp keeps the pointer).
    wanted = getattr(_capture, "wanted", None)
    if wanted is None and not log.isEnabledFor(logging.DEBUG):
        return
    line = text.decode("utf-8", "replace")
    if wanted is not None and (m := wanted[0].search(line)):
        wanted[1].append(float(m.group(1)))
    log.debug("%s", line.rstrip())


# ----- files: the converted model, the tokenizer -------------------------------------------


def quantized_model(source: Path, cache_dir: Path, quant: str, threads: int) -> Path:
    """``source`` converted to ``quant`` once, cached under ``cache_dir``; ``source`` itself for "none"."""
    if quant == "none":
        return source
    target = cache_dir / "models" / f"{gguf_cache_key(source)}.{quant}.gguf"
    return made_once(target, Path.exists, lambda partial: _quantize(source, target, partial, quant, threads))


def _quantize(source: Path, target: Path, partial: Path, quant: str, threads: int) -> None:
    lc = llama()
    log.info("converting %s to %s (once): %s", source.name, quant, target)
    params = lc.llama_model_quantize_default_params()
    params.ftype = QUANT_TYPES[quant]
    params.nthread = threads
    params.allow_requantize = True  # the shipped model is quantized already
    if lc.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not convert {source} to {quant}")


def load_tokenizer(gguf: Path, cache_dir: Path) -> Any:
    """The model's HF tokenizer (and chat template), read from the GGUF once, then from the cache."""
    from transformers import AutoTokenizer

    saved = cache_dir / "models" / gguf_cache_key(gguf)  # the torch engine's converted copy of the same file
    if not has_tokenizer(saved):
        saved = made_once(tokenizer_cache_dir(gguf, cache_dir), has_tokenizer,  # slow: parses the GGUF
                          lambda partial: AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
                          .save_pretrained(partial))
    return AutoTokenizer.from_pretrained(saved)


def model_footprint_bytes(model: Any, cells: int) -> int:
    """llama.cpp's count of a loaded model's weights (``llama_model_size``) plus the KV cache a context of
    ``cells`` preallocates: cells x layers x the K and V rows."""
    lc = llama()
    return int(lc.llama_model_size(model)) + cells * lc.llama_model_n_layer(model) * sum(kv_rows(model))


def kv_rows(model: Any) -> tuple[int, int]:
    """Bytes a cell of one layer takes in the K and in the V cache (f16, llama.cpp's default cache type): the
    head size (the GGUF's ``attention.key_length`` / ``value_length``, else the width over the heads) times
    the KV heads."""
    lc = llama()
    heads, kv_heads = lc.llama_model_n_head(model), lc.llama_model_n_head_kv(model)
    width = lc.llama_model_n_embd(model) // max(1, heads)
    arch = _meta(model, "general.architecture")
    k = _meta(model, f"{arch}.attention.key_length")
    v = _meta(model, f"{arch}.attention.value_length")
    k_head = int(k) if k and k.isdigit() else width
    v_head = int(v) if v and v.isdigit() else k_head
    return 2 * k_head * kv_heads, 2 * v_head * kv_heads


def _meta(model: Any, key: str) -> str | None:
    """A GGUF metadata value of the loaded model, as text (None: absent)."""
    buf = ctypes.create_string_buffer(256)
    n = llama().llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode(errors="replace") if n >= 0 else None


# ----- one sequence's KV, as llama.cpp saves it -----------------------------------------


def sequence_state(ctx: Any, seq: int, spare: int = 0) -> bytearray | None:
    """Sequence ``seq``'s cells as llama.cpp saves one sequence (``llama_state_seq_get_data_ext``), written in place
    into a buffer with ``spare`` zeroed bytes after them; None when it holds nothing or llama.cpp wrote short.
    A writable buffer (``kv_store.payload_buffer``: a mapping of its own when large), so a store keeps it and ctypes
    reads it without a copy (a state is ~23 KiB a token)."""
    lc = llama()
    size = lc.llama_state_seq_get_size_ext(ctx, seq, 0)
    if size == 0:
        return None
    data = payload_buffer(size + spare)
    if lc.llama_state_seq_get_data_ext(ctx, (ctypes.c_uint8 * size).from_buffer(data), size, seq, 0) != size:
        return None
    return data


def set_sequence_state(ctx: Any, seq: int, state: bytearray) -> int:
    """Write a saved state into the empty sequence ``seq``, read in place; the bytes llama.cpp read (0: refused,
    another layout or no room)."""
    return llama().llama_state_seq_set_data_ext(ctx, (ctypes.c_uint8 * len(state)).from_buffer(state), len(state),
                                                seq, 0)


@functools.lru_cache(maxsize=64)
def _floats(n: int) -> Any:
    return ctypes.c_float * n


def float_rows(pointer: Any, rows: int, width: int) -> np.ndarray:
    """A view of llama.cpp's ``rows`` x ``width`` floats at ``pointer`` (its logits), valid until its next decode.
    ``np.ctypeslib.as_array`` builds a ctypes array type on every call: 38 us a decode step, right after
    ``llama_decode`` (issue 51, AMD EPYC); the type is made once per size here."""
    address = ctypes.cast(pointer, ctypes.c_void_p).value
    return np.frombuffer(_floats(rows * width).from_address(address), dtype=np.float32).reshape(rows, width)
