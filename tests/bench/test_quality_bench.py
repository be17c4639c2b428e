"""``headrace bench quality``: the fixed prompt set, the flags, and a smoke run of both engines on every KV path
(a few prompts, short answers) whose table and results hold together and whose paths were really taken."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from conftest import in_process
from headrace.bench.quality import QualityOptions, holds_bar, options_from
from headrace.cli import main
from headrace.quality.paths import PATHS
from headrace.quality.prompts import KINDS, PromptSet, QualityPrompt


def test_the_prompt_set_takes_every_kind_in_turn_and_names_itself_by_its_tokens():
    prompts = tuple(QualityPrompt(f"{k}-{i}", k, tuple(range(i + 10)), 3) for k in KINDS for i in range(3))
    full = PromptSet(prompts)
    small = full.subset(len(KINDS))
    assert sorted(p.kind for p in small) == sorted(KINDS) and small.digest != full.digest
    assert full.subset(100) is full and PromptSet(prompts).digest == full.digest
    other = PromptSet(prompts[:-1] + (QualityPrompt("x", "long", (1, 2, 3, 4), 2),))
    assert other.digest != full.digest
    for p in prompts:  # the floor's pieces never cut where the fork does
        a, b = p.pieces()
        assert 0 < a < b < len(p.tokens) and p.split not in (a, b)


def test_the_held_out_set_shares_no_prompt_with_the_main_set():
    from headrace.bench.quality_prompts import quality_prompt_set
    from headrace.plugins.engines.llama_cpp.options import DEFAULT_MODEL
    from headrace.plugins.engines.models.paths import resolve_model
    from headrace.quality.reference import Reference

    tokenizer = Reference.load(resolve_model(DEFAULT_MODEL)).tokenizer
    main_set, held_out = quality_prompt_set(tokenizer), quality_prompt_set(tokenizer, name="held-out")
    assert len(held_out) == 50 + 90 and set(held_out.kinds()) == set(KINDS)
    seen = {p.tokens for p in main_set}
    assert not [p.id for p in held_out if p.tokens in seen]
    # Not even a user message in common: a question asked again under another frame is not held out.
    def users(s):
        return {m["content"] for p in s if p.messages for m in p.messages if m["role"] == "user"}
    assert not users(main_set) & users(held_out)


def test_the_flags_are_checked_and_the_bar_is_the_issues():
    def args(**kw):
        base = dict(quality_engines=["llama-cpp"], quality_quantize=["none"], quality_dtypes=["float32"],
                    quality_prompts=0, quality_tokens=32, quality_paths=[], quality_paths_everywhere=False, seed=0)
        return SimpleNamespace(**{**base, **kw})

    assert options_from(args()).paths == list(PATHS)
    assert "unknown" in options_from(args(quality_engines=["vllm"]))
    assert "unknown" in options_from(args(quality_paths=["cold", "warp"]))
    assert "--quality-tokens" in options_from(args(quality_tokens=0))
    assert "--quality-set" in options_from(args(quality_set="train"))
    assert options_from(args(quality_set="held-out")).prompt_set == "held-out"
    assert QualityOptions().tokens == 32
    assert holds_bar(0.97, 0.02) and not holds_bar(0.969, 0.001) and not holds_bar(0.99, 0.021)


@pytest.mark.slow
def test_a_smoke_run_scores_both_engines_on_every_path(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/setup builds it)")
    out = tmp_path / "quality"
    result = in_process(main, "bench", "quality", "--quality-prompts", "3", "--quality-tokens", "4",
                        "--quality-engines", "llama-cpp", "torch", "--quality-quantize", "none",
                        "--quality-dtypes", "float32", "--quality-paths-everywhere", "--out", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    rows = results["rows"]
    assert [(r["engine"], r["path"]) for r in rows] == [(e, p) for e in ("llama-cpp", "torch") for p in PATHS]
    for r in rows:
        # Every prompt by the path asked for (paths.py refuses another), every answer compared.
        assert r["taken"] == r["of"] == 3 and r["not_taken"] == [], r
        assert r["tokens"] == 12 and r["answers_compared"] == 3 and 0 <= r["identical"] <= 1
        assert 0 <= r["mean_kl"] <= r["max_kl"] and 0 <= r["top1"] <= 1
        assert r["decode_tok_s"] > 0 and r["holds_bar"] == holds_bar(r["top1"], r["mean_kl"])
    # The config's own engine (llama-cpp, the file as installed) is marked; the prompt set is named.
    assert [r["default"] for r in rows] == [True] * len(PATHS) + [False] * len(PATHS)
    assert results["prompt_set"]["prompts"] == 3 and len(results["prompt_set"]["digest"]) == 16
    # The tiers' own counts: each prompt restored from host memory, then from disk after the restart.
    for label in ("llama-cpp none", "torch float32"):
        engine = results["engines"][label]
        assert engine["reuse_stats"]["kv_store_host_hits"] >= 3 and engine["disk_stats"]["kv_store_disk_hits"] == 3
    # torch in float32 is the reference's own arithmetic on the same weights: next to nothing apart.
    torch_cold = next(r for r in rows if r["engine"] == "torch" and r["path"] == "cold")
    assert torch_cold["mean_kl"] < 1e-3 and torch_cold["top1"] == 1.0
    table = (out / "results.md").read_text()
    assert "CPU:" in table and "avx" in table and "| mean KL |" in table and "Command: `headrace bench quality" in table
    for name in ("cold prefill", "prefix-cache hit", "fork", "host memory", "disk", "numeric floor"):
        assert name in table


@pytest.mark.slow
def test_a_resumed_run_keeps_what_was_measured_and_measures_the_rest(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/setup builds it)")
    out = tmp_path / "quality"
    common = ("bench", "quality", "--quality-prompts", "2", "--quality-tokens", "3", "--quality-engines", "llama-cpp",
              "--quality-paths", "cold", "fork", "--out", str(out))
    first = in_process(main, *common, "--quality-quantize", "none")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    before = {r["variant"]: r for r in json.loads((out / "results.json").read_text())["rows"] if r["path"] == "cold"}
    second = in_process(main, *common, "--quality-quantize", "none", "Q8_0", "--quality-resume")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resuming: 2 rows kept" in second.stdout and "reference: rows from" in second.stdout
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [(r["variant"], r["path"]) for r in rows] == [("none", "cold"), ("none", "fork"), ("Q8_0", "cold")]
    # The kept row is the first run's, as measured then; only Q8_0 ran now.
    assert rows[0] == before["none"]
    assert "llama-cpp Q8_0: cold" in second.stdout and "llama-cpp none: cold" not in second.stdout
