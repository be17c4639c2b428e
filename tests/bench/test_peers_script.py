"""scripts/bench/peers.py runs end to end (--tiny, the llama-cpp and llama-server pairs, in one run) and writes every
figure, so it cannot rot.

The llama-server pair needs llama.cpp's llama-server, which scripts/build-llama-server builds once and caches:
about 20 CPU-minutes (24 minutes on the 2-core dev machine), too long for a test. Where it is not built, the run
covers the llama-cpp pair alone and the llama-server test is skipped, saying how to build it.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench" / "peers.py"
BUILD = ROOT / "scripts" / "build-llama-server"


def positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def llama_server_built() -> bool:
    return subprocess.run([str(BUILD), "--cached"], capture_output=True, cwd=ROOT).returncode == 0


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One --tiny run of the llama-cpp pair, and of the llama-server pair where its binary is built: the JSON, stdout."""
    pairs = ["llama-cpp", "llama-server"] if llama_server_built() else ["llama-cpp"]
    out = tmp_path_factory.mktemp("peers") / "peers.json"
    # The servers start one after the other; HF_HUB_OFFLINE comes from conftest's environment.
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--pair", *pairs, "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300 + 450 * len(pairs))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["tiny"] is True and res["endpoint"] == "/v1/completions"
    assert list(res["pairs"]) == pairs  # only the pairs asked for
    assert positive(res["meta"]["elapsed_s"])
    # The table printed after the JSON was written, with a prefill row per pair.
    assert "decode tok/s, 1 stream" in proc.stdout and "TTFT" in proc.stdout
    assert proc.stdout.count(f"prefill tok/s, {res['prefill_streams']}x") == len(pairs)
    return res, proc.stdout


def check_pair(res: dict, pair: dict) -> None:
    assert "skipped" not in pair, pair
    levels = [str(c) for c in res["concurrency"]]
    for role in ("headrace", "peer"):
        measured = pair[role]
        assert sorted(measured["levels"]) == sorted(levels), role
        for conc, figures in measured["levels"].items():
            assert figures["requests"] == int(conc) * res["rounds"] * res["repeat"], (role, conc, figures)
            assert positive(figures["tokens"]) and positive(figures["tok_s"]), (role, conc, figures)
        assert positive(measured["ttft"]["ttft_s"]) and positive(measured["ttft"]["prompt_tokens"]), measured["ttft"]
        assert len(measured["ttft"]["ttft_s_reps"]) == res["ttft_reps"] * res["repeat"]
        # Prefill: prefill_streams concurrent one-token requests a round, no two prompts sharing a prefix.
        prefill = measured["prefill"]
        assert prefill["streams"] == res["prefill_streams"], prefill
        assert positive(prefill["tok_s"]) and len(prefill["tok_s_rounds"]) == res["rounds"] * res["repeat"], prefill
        assert all(positive(w) for w in prefill["wall_s_rounds"]), prefill
        assert prefill["prompt_tokens"] >= prefill["streams"] * res["prefill_prompt_tokens_target"] // 2, prefill
        assert all(positive(n) for n in prefill["prompt_tokens_reported_rounds"]), prefill
        assert prefill["longest_shared_prefix"] == 0, prefill
        assert "other_processes" in measured["cpu_cores"]
    # headrace reports its usage when streaming.
    assert all(positive(f["tokens_reported"]) for f in pair["headrace"]["levels"].values())
    # Both servers load the same converted GGUF.
    assert pair["settings"]["model_file"] in pair["peer"]["argv"]
    assert sorted(pair["ratios"]["tok_s"]) == sorted(levels)
    assert all(positive(r) for r in pair["ratios"]["tok_s"].values()) and positive(pair["ratios"]["ttft"])
    assert positive(pair["ratios"]["prefill_tok_s"])


def test_tiny_llama_cpp_pair_writes_every_figure(tiny_run):
    res, _ = tiny_run
    check_pair(res, res["pairs"]["llama-cpp"])


def test_tiny_llama_server_pair_writes_every_figure(tiny_run):
    res, stdout = tiny_run
    if "llama-server" not in res["pairs"]:
        pytest.skip("llama-server is not built: run scripts/build-llama-server once (about 20 CPU-minutes)")
    pair = res["pairs"]["llama-server"]
    check_pair(res, pair)
    # llama.cpp's own server from the installed llama-cpp-python's sources, with 16 slots, already built.
    settings, argv = pair["settings"], pair["peer"]["argv"]
    assert Path(settings["llama_server"]).is_file() and argv[0] == settings["llama_server"]
    assert argv[argv.index("-np") + 1] == "16" and "--cont-batching" in argv
    assert settings["built_now"] is False and positive(settings["build_seconds"])
    assert "llama.cpp's llama-server" in stdout


def test_repeats_combine_into_medians_and_keep_every_start():
    """--repeat N: each figure is the median over the N starts of one server, every start's figure kept beside it."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from peers import combine_repeats
    finally:
        sys.path.remove(str(SCRIPT.parent))

    def start(tok_s: float, ttft: float, prefill: float, reported) -> dict:
        return {"server": "s", "cpu_cores": {"pids": 1.0},
                "levels": {"1": {"requests": 3, "tokens": 300, "tok_s": tok_s, "tok_s_rounds": [tok_s] * 3,
                                 "tokens_reported": reported}},
                "ttft": {"prompt_tokens": 1000, "ttft_s": ttft, "ttft_s_reps": [ttft] * 5},
                "prefill": {"streams": 16, "prompt_tokens": 6400, "tok_s": prefill, "tok_s_rounds": [prefill] * 3,
                            "wall_s_rounds": [1.0] * 3, "prompt_tokens_reported_rounds": [6400] * 3}}

    out = combine_repeats([start(50.0, 3.0, 400.0, 300), start(70.0, 2.0, 300.0, 300), start(60.0, 9.0, 350.0, 300)])
    assert out["repeats"] == 3
    level = out["levels"]["1"]
    assert level["tok_s"] == 60.0 and level["tok_s_repeats"] == [50.0, 70.0, 60.0]
    assert level["requests"] == 9 and level["tokens"] == 900 and level["tokens_reported"] == 900
    assert len(level["tok_s_rounds"]) == 9
    assert out["ttft"]["ttft_s"] == 3.0 and len(out["ttft"]["ttft_s_reps"]) == 15
    assert out["prefill"]["tok_s"] == 350.0 and out["prefill"]["tok_s_repeats"] == [400.0, 300.0, 350.0]
    # A server that reports no usage when streaming in any start has no reported total.
    assert combine_repeats([start(1.0, 1.0, 1.0, None), start(1.0, 1.0, 1.0, 5)])["levels"]["1"]["tokens_reported"] is None
