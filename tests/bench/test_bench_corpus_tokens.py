"""headrace bench sizes its corpus in the served LLM's tokens, whichever built-in engine serves it."""

from pathlib import Path

from headrace.bench.subcommand import llm_tokenizer
from headrace.bench.corpus import build_corpus

ROOT = Path(__file__).resolve().parents[2]


def test_llama_cpp_and_torch_configs_build_the_same_corpus():
    # With llama-cpp the default, the tokenizer once fell back to words, so its documents were ~60%
    # longer than torch's and every workflow comparison between the two engines measured different work.
    counts = {}
    for config in ("default.toml", "torch.toml"):
        tokens = llm_tokenizer(ROOT / "configs" / config)
        corpus = build_corpus(0, count_tokens=lambda text: len(tokens(text)))
        counts[config] = [(d.tokens, d.text) for d in corpus.documents]
        words = sum(len(d.text.split()) for d in corpus.documents)
        assert sum(d.tokens for d in corpus.documents) > 1.2 * words  # BPE tokens, not words
    assert counts["default.toml"] == counts["torch.toml"]
