"""The ``headrace`` command: serve, run, profile, ingest, check, pull, plugins, version."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from headrace import __version__
from headrace.daemon import heap
from headrace.daemon.config import ConfigError, default_config_path, load_config
from headrace.daemon.quiet import quiet_libraries
from headrace.graph.collection_refs import UnknownCollection
from headrace.graph.workflow import UnknownWorkflow, WorkflowInputError
from headrace.plugins.manager import PluginError, collect


def _add_config(parser: argparse.ArgumentParser) -> None:
    """``--config``: the daemon's TOML, with the same meaning and default in every subcommand."""
    parser.add_argument("--config", type=Path, default=default_config_path(),
                        help="the daemon's TOML config: engines, server, batching "
                             "(default: $HEADRACE_CONFIG, else the packaged CPU default, configs/default.toml)")


def build_parser() -> tuple[argparse.ArgumentParser, Any]:
    """The parser and its subcommands (``headrace.cli`` adds ``bench`` to them)."""
    parser = argparse.ArgumentParser(prog="headrace", description="Serve compound-AI workflows.")
    parser.add_argument("--version", action="version", version=f"headrace {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the daemon")
    _add_config(serve)
    serve.add_argument("--host", help="server.host")
    serve.add_argument("--port", type=int, help="server.port")
    serve.add_argument("--api-key", help="server.api_key (or HEADRACE_API_KEY)")
    serve.add_argument("--data-dir", help="data.dir")
    serve.add_argument("--log-level", help="server.log_level")
    run = sub.add_parser("run", help="run a workflow in this process and print its result and node timings")
    run.add_argument("workflow")
    run.add_argument("--input", action="append", default=[], metavar="KEY=VALUE",
                     help="a workflow input (JSON, or @file for a file's text); repeat a key for a list")
    _add_config(run)
    run.add_argument("--run-config", type=Path, metavar="FILE", help="the run's config (its JSON object) from a file")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="settings",
                     help="one run config setting (JSON, else a string), over --run-config; "
                          "a dotted key sets a nested one (optimize.passes=[]); repeatable")
    prof = sub.add_parser("profile", help="measure an engine's max efficient batch size")
    prof.add_argument("engine")
    prof.add_argument("--max-batch", type=int, default=256, help="largest batch size to try")
    _add_config(prof)
    ingest = sub.add_parser("ingest", help="load text and markdown files into a collection of a running daemon")
    ingest.add_argument("collection", help="the collection (created when missing)")
    ingest.add_argument("paths", nargs="+", metavar="PATH",
                        help="files, or directories (their .txt and .md files, recursively); a document's id is "
                             "its path relative to the argument, so ingesting again replaces it")
    ingest.add_argument("--url", default=os.environ.get("HEADRACE_URL", "http://127.0.0.1:8000"),
                        help="the daemon (default: $HEADRACE_URL or http://127.0.0.1:8000)")
    ingest.add_argument("--api-key", default=os.environ.get("HEADRACE_API_KEY"),
                        help="its API key (default: $HEADRACE_API_KEY)")
    ingest.add_argument("--chunk-size", type=int, help="words per chunk, if the collection is created (default 256)")
    ingest.add_argument("--chunk-overlap", type=int, help="words shared by neighbouring chunks, if it is created")
    ingest.add_argument("--embedding-model", help="the embed engine, if it is created (default: the first)")
    ingest.add_argument("--no-chunk-kv", action="store_true",
                        help="if it is created: do not prefill its chunks' KV at ingest (chunk_kv false)")
    ingest.add_argument("--no-progress", action="store_true", help="no progress bar")
    check = sub.add_parser("check", help="prove that each native engine of the config runs on this CPU, in child "
                                         "processes (scripts/setup ends with it); exit 1 names what fails")
    _add_config(check)
    pull = sub.add_parser("pull", help="fetch hf: models from the Hugging Face Hub into its cache ahead of serving, "
                                       "and print each one's local path")
    pull.add_argument("models", nargs="*", metavar="MODEL",
                      help="hf:<org>/<repo>[@<revision>][:<quant>] or hf:<org>/<repo>[@<revision>]/<file>.gguf "
                           "(default: every hf: model of --config)")
    _add_config(pull)
    unit = sub.add_parser("systemd-unit", help="print the hardened systemd service unit (configs/headrace.service is "
                                               "its default)")
    unit.add_argument("--user", help="run as this dedicated system user (default: a dynamic one, DynamicUser=yes)")
    unit.add_argument("--exec", dest="exec_start", default="headrace",
                      help="the headrace executable, a full path outside /home (default: headrace, on PATH)")
    unit.add_argument("--config", default="/etc/headrace/headrace.toml", help="the config the service reads")
    sub.add_parser("plugins", help="list the loaded plugins and what each registers")
    sub.add_parser("version", help="print the version")
    return parser, sub


def main(argv: Sequence[str] | None = None) -> int:
    parser, _ = build_parser()
    return dispatch(parser.parse_args(argv))


def dispatch(args: argparse.Namespace) -> int:
    """Run a daemon subcommand; a bad config, plugin or input is one line on stderr and exit status 2."""
    try:
        if args.command == "version":
            print(f"headrace {__version__}")
            return 0
        if args.command == "plugins":
            return _plugins()
        if args.command == "systemd-unit":
            return _systemd_unit(args)
        if args.command in ("run", "profile"):
            return _local(args)
        if args.command == "ingest":
            return _ingest(args)
        if args.command == "check":
            return _check(args)
        if args.command == "pull":
            return _pull(args)
        return _serve(args)
    except (ConfigError, PluginError, WorkflowInputError, UnknownWorkflow, UnknownCollection) as exc:
        print(f"headrace: {exc}", file=sys.stderr)
        return 2
    except BaseExceptionGroup as group:  # raised through a task group: report the cause
        from headrace.graph.executor import first_error

        cause = first_error(group)
        if isinstance(cause, (ConfigError, PluginError, WorkflowInputError, UnknownWorkflow, UnknownCollection)):
            print(f"headrace: {cause}", file=sys.stderr)
            return 2
        raise


def _local(args: argparse.Namespace) -> int:
    import anyio

    # The config and the flags are checked before anything imports torch: a typo fails in a blink.
    config = load_config(args.config)
    if args.command == "profile" and args.engine not in {e.name for e in config.engines}:
        raise ConfigError("engine", f"no engine named {args.engine!r} in {args.config}")
    run_config = _run_config(args) if args.command == "run" else {}
    _fetch_hub_models(config)
    quiet_libraries()
    logging.basicConfig(level="WARNING", format="%(message)s")
    logging.getLogger("headrace.daemon.engine_residency").setLevel("INFO")  # one line per engine as it loads
    from headrace.daemon import local, profiling

    if args.command == "profile":
        return anyio.run(profiling.profile, config, args.engine, args.max_batch)
    return anyio.run(local.run_workflow, config, args.workflow, args.input, run_config)


def _run_config(args: argparse.Namespace) -> dict[str, Any]:
    """``--run-config``'s JSON object, then each ``--set`` over it."""
    run_config: dict[str, Any] = {}
    if args.run_config is not None:
        try:
            run_config = json.loads(args.run_config.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError("--run-config", f"{args.run_config}: {exc}") from None
        if not isinstance(run_config, dict):
            raise ConfigError("--run-config", f"{args.run_config}: expected a JSON object")
    for setting in args.settings:
        key, sep, raw = setting.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"--set {setting}", "expected key=value")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        *parents, leaf = key.split(".")
        table = run_config
        for part in parents:
            if not isinstance(table.get(part, {}), dict):
                raise ConfigError(f"--set {setting}", f"{part!r} is already set to a value that is not an object")
            table = table.setdefault(part, {})
        table[leaf] = value
    return run_config


def _ingest(args: argparse.Namespace) -> int:
    from headrace.daemon.ingest import IngestError, ingest

    try:
        return ingest(args.collection, args.paths, args.url, args.api_key, progress=not args.no_progress,
                      settings={"chunk_size": args.chunk_size, "chunk_overlap": args.chunk_overlap,
                                "embedding_model": args.embedding_model,
                                "chunk_kv": False if args.no_chunk_kv else None})
    except IngestError as exc:
        print(f"headrace ingest: {exc}", file=sys.stderr)
        return exc.status


def _check(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level="WARNING", format="%(message)s")  # a variant skipped is a warning line
    from headrace.daemon.engine_check import check_engines, report

    text, status = report(check_engines(config))
    print(text, file=sys.stdout if status == 0 else sys.stderr)
    return status


def _pull(args: argparse.Namespace) -> int:
    from headrace.plugins.engines.models import hub_models
    from headrace.plugins.engines.models.paths import ModelNotFound

    models = [("model", m) for m in args.models] or hub_models.config_models(load_config(args.config))
    if not models:
        print(f"headrace pull: {args.config} names no hf: model; name one: headrace pull hf:<org>/<repo>[:<quant>]",
              file=sys.stderr)
        return 2
    for key, ref in models:
        if not hub_models.is_hub_ref(ref):
            raise ConfigError(key, f"{ref!r} is not an hf: model; pull fetches {hub_models.GRAMMAR}")
    status = 0
    for key, ref in models:
        try:
            print(hub_models.pull(ref, key), flush=True)  # stdout: the paths alone, for scripts
        except (ValueError, ModelNotFound) as exc:
            print(f"headrace pull: {exc}", file=sys.stderr)
            status = 1
    return status


def _fetch_hub_models(config: Any) -> None:
    """Fetch the config's hf: models the cache lacks (unless HF_HUB_OFFLINE=1), once, before the engines are built;
    from then on models come from disk, never a hub."""
    from headrace.plugins.engines.models import hub_models

    try:
        hub_models.fetch_config_models(config)
    except (ValueError, FileNotFoundError) as exc:  # a bad hf: name, or a model missing offline: one line, exit 2
        raise ConfigError(str(exc)) from None
    hub_models.offline_by_default()


def _systemd_unit(args: argparse.Namespace) -> int:
    from headrace.daemon.systemd import unit

    try:
        sys.stdout.write(unit(args.user, args.exec_start, args.config))
    except ValueError as exc:
        raise ConfigError("systemd-unit", str(exc)) from None
    return 0


def _plugins() -> int:
    registry = collect()
    for plugin, hooks in sorted(registry.by_plugin.items()):
        print(plugin)
        for hook, names in sorted(hooks.items()):
            print(f"  {hook}: {', '.join(names)}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    config = load_config(  # before anything imports torch: a bad key fails in a blink
        args.config,
        overrides={"server.host": args.host, "server.port": args.port, "server.api_key": args.api_key,
                   "data.dir": args.data_dir, "server.log_level": args.log_level},
    )
    if not config.engines:
        raise ConfigError("engines", f"no engines configured in {args.config}")
    # Before any thread allocates: glibc fixes a thread's arena limit when it first needs one.
    memory = config.memory
    tuned = heap.tune(memory.malloc_arena_max, memory.malloc_mmap_threshold_kib, memory.malloc_trim_threshold_kib)
    _fetch_hub_models(config)
    # A fatal signal in native code (an engine's library: SIGILL, SIGSEGV...) logs every thread's Python
    # stack before the process dies; the engines' worker-thread lines say which thread is which engine.
    with contextlib.suppress(AttributeError, ValueError, io.UnsupportedOperation):  # stderr is no file: nowhere to dump
        faulthandler.enable(all_threads=True)
    quiet_libraries()
    logging.basicConfig(level=config.server.log_level.upper() if config.server.log_level != "trace" else "DEBUG",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger(__name__).info("malloc: %s", ", ".join(f"{k} = {v}" for k, v in tuned.items()) or "glibc's own")
    import uvicorn

    from headrace.daemon.app import create_app
    from headrace.daemon.lifecycle import DrainingServer

    app = create_app(config)  # builds every engine (not loading yet): bad models fail here
    # The drain (server.drain_seconds) has let in-flight work finish before uvicorn shuts down;
    # its own grace period then only covers the last writes of requests the drain cut short.
    server = DrainingServer(
        uvicorn.Config(app, host=config.server.host, port=config.server.port, log_level=config.server.log_level,
                       timeout_keep_alive=config.server.keep_alive_seconds, timeout_graceful_shutdown=5),
        app.state.services.lifecycle,
    )
    server.run()
    return server.exit_status


if __name__ == "__main__":
    sys.exit(main())
