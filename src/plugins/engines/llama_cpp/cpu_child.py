"""The child processes of ``cpu``'s variant choice, run as ``python -m`` (``CHILD_MODULE``): ``scores`` prints
each CPU backend library's score, ``probe`` a short prefill and decode on the variant ``VARIANT_ENV`` names. A
module of their own: the probe loads llama.cpp through ``files``, which imports ``cpu``.
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

from headrace.plugins.engines.llama_cpp.cpu import _no_core_dump, variant_name


def _child_scores(libraries: list[str]) -> None:
    # ggml's backend modules carry no rpath: the base library they link must be loaded first.
    for library in libraries:
        base = Path(library).resolve().parent / "libggml-base.so.0"
        if base.exists():
            ctypes.CDLL(str(base), mode=ctypes.RTLD_GLOBAL)
            break
    scores = {}
    for library in libraries:
        lib = ctypes.CDLL(library)
        score = getattr(lib, "ggml_backend_score", None)
        scores[variant_name(Path(library))] = int(score()) if score is not None else 0
    print(json.dumps(scores))


def _child_probe(source: str, cache_dir: str, quant: str, threads: str) -> None:
    # The variant comes from VARIANT_ENV, set by the parent: llama() loads it without probing again.
    import numpy as np

    from headrace.plugins.engines.llama_cpp.files import llama, quantized_model  # here: the scores child imports no torch

    lc = llama()
    model_file = quantized_model(Path(source), Path(cache_dir), quant, int(threads))
    model = lc.llama_model_load_from_file(str(model_file).encode(), lc.llama_model_default_params())
    if not model:
        raise SystemExit(f"llama.cpp could not load {model_file}")
    params = lc.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = 256, 128, 128
    params.n_threads = params.n_threads_batch = int(threads)
    ctx = lc.llama_init_from_model(model, params)
    vocab = lc.llama_model_get_vocab(model)
    # A prompt long enough for the batched (prefill) kernels, then single-token (decode) steps.
    text = ("The water wheel turns as the headrace carries water to the mill. " * 8).encode()
    tokens = (lc.llama_token * 256)()
    n = lc.llama_tokenize(vocab, text, len(text), tokens, 256, True, False)
    if n <= 0 or lc.llama_decode(ctx, lc.llama_batch_get_one(tokens, n)) != 0:
        raise SystemExit("llama_decode failed on the probe's prompt")
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    for _ in range(4):
        best = int(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).argmax())
        one = (lc.llama_token * 1)(best)
        if lc.llama_decode(ctx, lc.llama_batch_get_one(one, 1)) != 0:
            raise SystemExit("llama_decode failed on a decode step")
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    print("ok")


if __name__ == "__main__":
    _no_core_dump()  # here, not as the parent's preexec_fn: the daemon has threads when it probes
    command, *args = sys.argv[1:]
    if command == "scores":
        _child_scores(args)
    elif command == "probe":
        _child_probe(*args[1:])
    else:
        raise SystemExit(f"unknown command {command!r}")
