"""The daemon's configuration: one small dataclass per area of the TOML file.

The file maps onto these dataclasses one to one (``[server]`` is ``ServerConfig``,
each ``[[engines]]`` entry is an ``EngineConfig``, ...). ``load_config`` layers the
sources, highest first: overrides (CLI flags) > ``HEADRACE_*`` env > file > defaults.

Environment variables are ``HEADRACE_<SECTION>_<FIELD>`` for the scalar fields of
``server``, ``data``, ``batching``, ``collections``, ``residency`` and ``memory`` (``HEADRACE_SERVER_PORT``, ``HEADRACE_DATA_DIR``,
``HEADRACE_DATA_CACHE_DIR``, ``HEADRACE_BATCHING_MAX_WAIT_MS``...) and for lists of
scalars, comma-separated (``HEADRACE_SERVER_API_KEYS=key1,key2``). ``HEADRACE_API_KEY``
is a short alias for ``server.api_key``; when both are set, the full name
``HEADRACE_SERVER_API_KEY`` wins (the more specific name always wins).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from headrace.graph.events import EVENT_LOG
from headrace.graph.workflow import MAX_TRACED_STEPS

ENV_PREFIX = "HEADRACE_"
API_KEY_ALIAS = "HEADRACE_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# Engine names are OpenAI model ids, so they must be safe in a URL path and JSON.
ENGINE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")


class ConfigError(ValueError):
    """A bad setting; ``str()`` is ``"<dotted key>: <problem>"``.

    ``ConfigError("message")`` with no key is allowed for errors about no one key.
    """

    def __init__(self, key: str, problem: str = "") -> None:
        if not problem:
            key, problem = "", key
        self.key, self.problem = key, problem
        super().__init__(f"{key}: {problem}" if key else problem)

    def under(self, prefix: str) -> ConfigError:
        """The same error seen from the enclosing table ``prefix``."""
        if not prefix:
            return self
        key = f"{prefix}{self.key}" if self.key.startswith("[") else f"{prefix}.{self.key}"
        return ConfigError(key, self.problem)


def _check(ok: bool, key: str, problem: str) -> None:
    if not ok:
        raise ConfigError(key, problem)


@dataclass(frozen=True)
class ServerConfig:
    """``[server]``: the HTTP listener."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks a free port (tests)
    api_key: str = ""  # empty: no auth; else clients send "Authorization: Bearer <key>"
    max_body_bytes: int = 4 * 1024 * 1024
    log_level: str = "info"
    # On SIGTERM the daemon drains: /ready turns 503, new requests get 503, and in-flight
    # requests and runs get this long to finish; whatever is left is then cancelled.
    drain_seconds: float = 30.0
    # How long an idle keep-alive connection stays open. Longer than clients keep theirs (httpx and the
    # OpenAI SDK: 5 s), so the client closes first: a server closing at the same moment races a client
    # reusing the connection, whose request then fails as a connection error.
    keep_alive_seconds: int = 65
    # More accepted keys, beside api_key (one per client, say). What a key creates (runs, sessions,
    # stored responses, collections) is its own: another key finds it absent (headrace.daemon.ownership).
    api_keys: list[str] = field(default_factory=list)
    # With several keys, a key's requests reuse only the cached KV (prefix cache, retained contexts, KV tiers)
    # its own requests left (issue 50): a cache hit tells no key what another sent. True: every key shares
    # them, as one key or none always does (one tenant whose clients each have a key).
    share_cache_across_keys: bool = False
    max_rerank_documents: int = 1000  # documents one /v1/rerank request may score; more is a 400
    # Starts every run and session id this daemon mints. Several daemons behind one router
    # (headrace-ray) each get their own, so the router tells from an id which daemon owns it.
    id_prefix: str = ""

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, "port", f"must be in 0..65535, got {self.port}")
        _check(self.max_body_bytes > 0, "max_body_bytes", "must be > 0")
        _check(self.log_level in LOG_LEVELS, "log_level",
               f"expected one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        _check(self.drain_seconds >= 0, "drain_seconds", f"must be >= 0, got {self.drain_seconds}")
        _check(self.keep_alive_seconds >= 1, "keep_alive_seconds", f"must be >= 1, got {self.keep_alive_seconds}")
        _check(self.max_rerank_documents >= 1, "max_rerank_documents",
               f"must be >= 1, got {self.max_rerank_documents}")
        # Ids travel in URL paths: letters, digits, '-' and '_' only.
        _check(re.fullmatch(r"[A-Za-z0-9_-]*", self.id_prefix) is not None, "id_prefix",
               f"must hold only letters, digits, '-' and '_', got {self.id_prefix!r}")
        # Keys travel in an HTTP header: printable ASCII without spaces, or no client could send them.
        named = {f"api_keys[{i}]": key for i, key in enumerate(self.api_keys)}
        if self.api_key:
            named["api_key"] = self.api_key
        for name, key in named.items():
            _check(bool(key) and key.isascii() and key.isprintable() and " " not in key, name,
                   "must be a non-empty string of printable ASCII without spaces")

    def keys(self) -> list[str]:
        """Every accepted API key (api_key, then api_keys), each once; empty: no auth."""
        return list(dict.fromkeys(k for k in (self.api_key, *self.api_keys) if k))

    def caches_per_key(self) -> bool:
        """Whether each key's requests get cached KV of their own: several keys, not shared by choice."""
        return len(self.keys()) > 1 and not self.share_cache_across_keys


def _xdg(var: str, fallback: str, env: Mapping[str, str]) -> Path:
    # The XDG spec says relative values are invalid and must be ignored.
    base = env.get(var, "")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / fallback
    return root / "headrace"


@dataclass(frozen=True)
class DataConfig:
    """``[data]``: where state (LanceDB tables...) and caches (converted models) live."""

    dir: str = ""  # empty: $XDG_DATA_HOME/headrace or ~/.local/share/headrace
    cache_dir: str = ""  # empty: $XDG_CACHE_HOME/headrace or ~/.cache/headrace

    def data_path(self, env: Mapping[str, str] = os.environ) -> Path:
        return Path(self.dir).expanduser() if self.dir else _xdg("XDG_DATA_HOME", ".local/share", env)

    def cache_path(self, env: Mapping[str, str] = os.environ) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else _xdg("XDG_CACHE_HOME", ".cache", env)


@dataclass(frozen=True)
class CollectionsConfig:
    """``[collections]``: persistent collections (``/v1/collections``), stored under the data dir."""

    # Vector search is exact (a scan of every chunk) until a collection holds this many chunks;
    # an ingest that reaches it builds LanceDB's ANN index (IVF partitions, HNSW inside each,
    # scalar-quantized vectors), after which a search probes only the nearest partitions.
    # Below a few tens of thousands of chunks a scan is fast and exact; 0 never builds one.
    ann_index_rows: int = 50_000

    def __post_init__(self) -> None:
        _check(self.ann_index_rows >= 0, "ann_index_rows", f"must be >= 0, got {self.ann_index_rows}")


@dataclass(frozen=True)
class SessionsConfig:
    """``[sessions]``: the semantic-variable sessions (``/v1/sessions``)."""

    # A session no request has touched for this long is closed, its work cancelled.
    idle_seconds: float = 600.0

    def __post_init__(self) -> None:
        _check(self.idle_seconds > 0, "idle_seconds", f"must be > 0, got {self.idle_seconds}")


@dataclass(frozen=True)
class WorkflowsConfig:
    """``[workflows]``: how far a workflow run may go."""

    # Engine calls one run of a traced workflow (debate, agent, router, a plugin's ``async def``) may
    # issue; the call past it fails the run, so a loop that never ends cannot hold the engines.
    max_traced_steps: int = MAX_TRACED_STEPS
    # Events each run holds for its readers (an SSE stream, GET /v1/runs/{id}/events). Publishing
    # never waits for a reader: one that falls this far behind is told how many it missed.
    run_events: int = EVENT_LOG
    # Finished runs kept for GET /v1/runs (the oldest finished one goes first): the newest 32 hold their
    # graph, inputs, node records and events; older ones what the routes serve, compressed (run_history).
    keep_runs: int = 1000
    # The memory the finished runs kept may hold, in MiB (each measured as it ends). Past it the oldest
    # finished runs drop their graph, events, passes and piece timings (GET /v1/runs/{id} says
    # details_dropped) and keep their summary and timeline; past it with summaries alone, the oldest go.
    run_history_mib: float = 64.0

    def __post_init__(self) -> None:
        _check(self.max_traced_steps >= 1, "max_traced_steps", f"must be >= 1, got {self.max_traced_steps}")
        _check(self.run_events >= 1, "run_events", f"must be >= 1, got {self.run_events}")
        _check(self.keep_runs >= 1, "keep_runs", f"must be >= 1, got {self.keep_runs}")
        _check(self.run_history_mib > 0, "run_history_mib", f"must be > 0, got {self.run_history_mib}")


@dataclass(frozen=True)
class ResponsesConfig:
    """``[responses]``: the stored responses of ``/v1/responses`` (under the data dir, each owned by its API key)."""

    # A stored response older than this is gone: GET answers 404, and a previous_response_id naming it too.
    # OpenAI keeps them 30 days.
    max_age_seconds: float = 30 * 24 * 3600.0

    def __post_init__(self) -> None:
        _check(self.max_age_seconds > 0, "max_age_seconds", f"must be > 0, got {self.max_age_seconds}")


def _check_batching(b: BatchingConfig | BatchingOverride) -> None:
    if b.policy is not None:
        _check(bool(b.policy), "policy", "must not be empty")
    if isinstance(b, BatchingConfig):
        _check(bool(b.llm_policy), "llm_policy", "must not be empty")
    for name in ("max_batch_size", "max_running"):
        value = getattr(b, name)
        _check(value is None or value >= 1, name, f"must be >= 1, got {value}")
    _check(b.max_wait_ms is None or b.max_wait_ms >= 0, "max_wait_ms", f"must be >= 0, got {b.max_wait_ms}")
    _check(b.max_runs is None or b.max_runs >= 0, "max_runs", f"must be >= 0, got {b.max_runs}")


@dataclass(frozen=True)
class BatchingConfig:
    """``[batching]``: how each engine's scheduler forms batches (global defaults)."""

    policy: str = "fifo"  # a batch policy registered by a plugin (embed, rerank, vector store)
    max_batch_size: int = 32
    max_wait_ms: float = 5.0  # how long a partial batch may wait for more requests; 0: never
    max_running: int = 64  # LLM admission: concurrent decoding requests; the rest queue
    # LLM admission: runs served at once (a plain request is a run of its own); the rest wait, let in
    # by the LLM policy's rank, so in overload a few runs finish on time instead of all late. 0: no bound.
    max_runs: int = 0
    # Batch size past which throughput stops rising (from `headrace profile`); 0: unknown.
    # Stage decomposition splits a larger batchable primitive into stages of this size.
    max_efficient_batch_size: int = 0
    # The LLM engines' scheduling policy (fifo, topology, objective, deadline; plugins add more). An LLM engine's
    # own [engines.batching] policy overrides it.
    llm_policy: str = "fifo"

    def __post_init__(self) -> None:
        _check_batching(self)


@dataclass(frozen=True)
class BatchingOverride:
    """``[engines.batching]``: per-engine overrides; unset (None) keys keep the global value."""

    policy: str | None = None
    max_batch_size: int | None = None
    max_wait_ms: float | None = None
    max_running: int | None = None
    max_runs: int | None = None
    max_efficient_batch_size: int | None = None

    def __post_init__(self) -> None:
        _check_batching(self)

    def apply(self, base: BatchingConfig) -> BatchingConfig:
        given = {f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}
        return dataclasses.replace(base, **given)


@dataclass(frozen=True)
class ResidencyConfig:
    """``[residency]``: which engines are loaded, under a memory budget for the device.

    With a budget, an engine that is not loaded loads when a request needs it, first unloading the
    least recently used evictable engines that have nothing in flight until it fits; and each
    workflow's learned call sequence (a first-order Markov model) loads the engines its runs are
    likely to call next ahead of the call.
    """

    # Bytes the loaded engines may hold together (CPU RAM here, GPU memory on a GPU), by each engine's
    # measured footprint; 0: no budget, every engine stays loaded.
    budget_bytes: int = 0
    pinned: list[str] = field(default_factory=list)  # engines never unloaded (those that cannot unload never are)
    preload: bool = True  # Markov preloading of the predicted next engines (with a budget)
    # A predicted engine is preloaded when the workflow's past runs reached it from where a run is now,
    # within ``preload_steps`` calls, with at least this probability.
    preload_min_probability: float = 0.3
    # How many calls ahead a run's engines are predicted (1: only the next call's); further ahead, a load
    # has more of the run's earlier calls to hide behind.
    preload_steps: int = 8
    # How long a request may wait for room (engines in flight to finish) before its load fails.
    load_wait_seconds: float = 300.0

    def __post_init__(self) -> None:
        _check(self.budget_bytes >= 0, "budget_bytes", f"must be >= 0, got {self.budget_bytes}")
        _check(0 < self.preload_min_probability <= 1, "preload_min_probability",
               f"must be in (0, 1], got {self.preload_min_probability}")
        _check(self.preload_steps >= 1, "preload_steps", f"must be >= 1, got {self.preload_steps}")
        _check(self.load_wait_seconds > 0, "load_wait_seconds", f"must be > 0, got {self.load_wait_seconds}")


@dataclass(frozen=True)
class MemoryConfig:
    """``[memory]``: glibc malloc's limits and trim (headrace.daemon.heap); 0 leaves glibc's own."""

    # Blocks from this size up get a mapping of their own, returned to the system on free. Fixed, so
    # glibc's own threshold does not climb (to 32 MiB) after the first large blocks are freed.
    malloc_mmap_threshold_kib: int = 1024
    # Free memory at a heap's top past this is returned at once (glibc's own follows the mmap threshold).
    malloc_trim_threshold_kib: int = 2048
    malloc_arena_max: int = 0  # arenas malloc may make (glibc's own: 8 per core)
    trim_seconds: float = 60.0  # every this long, every arena's free pages are returned (malloc_trim); 0: never

    def __post_init__(self) -> None:
        # glibc refuses an mmap threshold above 32 MiB (HEAP_MAX_SIZE / 2 on 64-bit).
        _check(0 <= self.malloc_mmap_threshold_kib <= 32 * 1024, "malloc_mmap_threshold_kib",
               f"must be in 0..32768, got {self.malloc_mmap_threshold_kib}")
        _check(self.malloc_trim_threshold_kib >= 0, "malloc_trim_threshold_kib",
               f"must be >= 0, got {self.malloc_trim_threshold_kib}")
        _check(self.malloc_arena_max >= 0, "malloc_arena_max", f"must be >= 0, got {self.malloc_arena_max}")
        _check(self.trim_seconds >= 0, "trim_seconds", f"must be >= 0, got {self.trim_seconds}")


@dataclass(frozen=True)
class EngineConfig:
    """One ``[[engines]]`` entry: a named model or tool served by an engine plugin."""

    name: str  # the OpenAI model id clients use
    plugin: str  # the engine plugin kind: "torch", "sentence-transformers", "lancedb"...
    model: str = ""  # a path, or "pkg:<module>/<file>" inside an installed package
    options: dict[str, Any] = field(default_factory=dict)  # passed as-is to the plugin
    batching: BatchingOverride | None = None

    def __post_init__(self) -> None:
        _check(bool(self.name), "name", "required")
        _check(bool(ENGINE_NAME_RE.match(self.name)), "name",
               f"{self.name!r} is not a valid model id (letters, digits, '.', '_', ':', '-';"
               " must start with a letter or digit)")
        _check(bool(self.plugin), "plugin", "required")


@dataclass(frozen=True)
class Config:
    """The whole configuration file."""

    server: ServerConfig = field(default_factory=ServerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    collections: CollectionsConfig = field(default_factory=CollectionsConfig)
    sessions: SessionsConfig = field(default_factory=SessionsConfig)
    workflows: WorkflowsConfig = field(default_factory=WorkflowsConfig)
    responses: ResponsesConfig = field(default_factory=ResponsesConfig)
    residency: ResidencyConfig = field(default_factory=ResidencyConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    engines: list[EngineConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for i, engine in enumerate(self.engines):
            _check(engine.name not in seen, f"engines[{i}].name", f"duplicate engine name {engine.name!r}")
            seen.add(engine.name)
        for i, name in enumerate(self.residency.pinned):
            _check(name in seen, f"residency.pinned[{i}]", f"no engine named {name!r} is configured")

    def engine(self, name: str) -> EngineConfig:
        for engine in self.engines:
            if engine.name == name:
                return engine
        raise KeyError(name)

    def batching_for(self, engine_name: str) -> BatchingConfig:
        """The global ``[batching]`` with this engine's own overrides applied."""
        override = self.engine(engine_name).batching
        return override.apply(self.batching) if override else self.batching

    def to_dict(self) -> dict[str, Any]:
        """Plain data for printing; the API key is redacted, unset overrides are left out."""
        out = dataclasses.asdict(self)
        if out["server"]["api_key"]:
            out["server"]["api_key"] = "***"
        out["server"]["api_keys"] = ["***"] * len(out["server"]["api_keys"])
        for engine in out["engines"]:
            given = {k: v for k, v in (engine.pop("batching") or {}).items() if v is not None}
            if given:
                engine["batching"] = given
        return out


# ----- dataclass-from-dict ----------------------------------------------------

_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "a boolean"}


def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass ``cls`` from plain data (parsed TOML), checking types by hints.

    Errors name the offending key by its full dotted ``path``.
    """
    _check(isinstance(data, Mapping), path, f"expected a table, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(_join(path, str(key)), f"unknown key{hint}")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], _join(path, name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(_join(path, name), "required")
    try:
        return cls(**kwargs)
    except ConfigError as e:  # raised by __post_init__, relative to this table
        raise e.under(path) from None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) != 1:
            raise TypeError(f"{path}: unsupported union type {tp}")
        return _convert(options[0], value, path)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if origin is list:
        _check(isinstance(value, list), path, f"expected a list, got {value!r}")
        return [_convert(args[0] if args else Any, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        _check(isinstance(value, Mapping), path, f"expected a table, got {value!r}")
        item = args[1] if args else Any
        return {str(k): _convert(item, v, _join(path, str(k))) for k, v in value.items()}
    if tp in _TYPE_NAMES:
        # TOML writes `max_wait_ms = 5` as an int: accept it for a float. bool is a
        # subclass of int, but `port = true` is a mistake: refuse it for numbers.
        accepted = (int, float) if tp is float else tp
        ok = isinstance(value, accepted) and (tp is bool or not isinstance(value, bool))
        _check(ok, path, f"expected {_TYPE_NAMES[tp]}, got {value!r}")
        return float(value) if tp is float else value
    raise TypeError(f"{path}: unsupported field type {tp}")


def _from_string(tp: Any, text: str) -> Any:
    """Parse an env var or CLI string as a scalar field of type ``tp``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if tp is bool:
        return {"true": True, "1": True, "false": False, "0": False}[text.strip().lower()]
    if tp in (int, float):
        return tp(text.strip())
    if typing.get_origin(tp) is list:  # comma-separated: HEADRACE_SERVER_API_KEYS=k1,k2
        return [_from_string(typing.get_args(tp)[0], item.strip()) for item in text.split(",") if item.strip()]
    return text


# ----- loading ----------------------------------------------------------------

# The sections whose scalar fields env vars and dotted overrides may set.
_SECTIONS: dict[str, type] = {"server": ServerConfig, "data": DataConfig, "batching": BatchingConfig,
                              "collections": CollectionsConfig, "sessions": SessionsConfig,
                              "workflows": WorkflowsConfig, "responses": ResponsesConfig,
                              "residency": ResidencyConfig, "memory": MemoryConfig}


def _read_file(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(str(path), "config file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(str(path), f"invalid TOML: {e}") from None


def _set(raw: dict[str, Any], section: str, name: str, value: Any, source: str) -> None:
    hints = typing.get_type_hints(_SECTIONS[section])
    if name not in hints:
        close = difflib.get_close_matches(name, list(hints), n=1)
        if source.startswith(ENV_PREFIX):
            hint = f"; did you mean {ENV_PREFIX}{section.upper()}_{close[0].upper()}?" if close else ""
            raise ConfigError(source, f"no setting {section}.{name}{hint}")
        raise ConfigError(source, "unknown key" + (f"; did you mean {close[0]!r}?" if close else ""))
    if isinstance(value, str) and hints[name] is not str:
        try:
            value = _from_string(hints[name], value)
        except (ValueError, KeyError):
            expected = _TYPE_NAMES.get(hints[name], "a valid value")
            if typing.get_origin(hints[name]) is list:
                expected = "a comma-separated list"
            raise ConfigError(source, f"expected {expected}, got {value!r}") from None
    table = raw.setdefault(section, {})
    _check(isinstance(table, dict), section, f"expected a table, got {table!r}")
    table[name] = value


def _env_settings(env: Mapping[str, str]) -> list[tuple[str, str, str, str]]:
    """(section, field, value, var name) for each HEADRACE_* var naming a section.

    Vars that name no section (HEADRACE_PLUGINS...) belong to others and are skipped;
    a var naming a section but no field of it is a typo and an error (in ``_set``).
    """
    found = []
    if API_KEY_ALIAS in env:  # first, so HEADRACE_SERVER_API_KEY overwrites it
        found.append(("server", "api_key", env[API_KEY_ALIAS], API_KEY_ALIAS))
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var == API_KEY_ALIAS:
            continue
        rest = var[len(ENV_PREFIX):].lower()
        for section in _SECTIONS:
            if rest.startswith(section + "_"):
                found.append((section, rest[len(section) + 1:], env[var], var))
    return found


def packaged_config_path() -> Path:
    """The CPU default config, shipped inside the package (``configs/default.toml`` links to it)."""
    return Path(str(importlib.resources.files("headrace.daemon").joinpath("default.toml")))


def default_config_path(env: Mapping[str, str] = os.environ) -> Path:
    """The daemon config a command loads when not given one: ``$HEADRACE_CONFIG``, else the packaged default."""
    return Path(env["HEADRACE_CONFIG"]) if env.get("HEADRACE_CONFIG") else packaged_config_path()


def load_config(
    path: Path | None,
    env: Mapping[str, str] = os.environ,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Load the config: ``overrides`` > ``HEADRACE_*`` in ``env`` > the file > defaults.

    ``overrides`` are dotted keys such as ``{"server.port": 9001, "data.dir": "/x"}``;
    string values are parsed by the field's type, like env values; None values are
    skipped (a CLI flag that was not given).
    """
    raw = _read_file(Path(path)) if path is not None else {}
    for section, name, value, var in _env_settings(env):
        _set(raw, section, name, value, var)
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        section, _, name = key.partition(".")
        _check(section in _SECTIONS and bool(name), key,
               f"unknown key; overrides are <{'|'.join(_SECTIONS)}>.<field>")
        _set(raw, section, name, value, key)
    return from_dict(Config, raw)
