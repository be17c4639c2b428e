"""The ``headrace`` command: serve, plugins, version."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from headrace import __version__
from headrace.daemon.config import ConfigError, load_config
from headrace.graph.collections import UnknownCollection
from headrace.graph.executor import first_error
from headrace.graph.service import UnknownWorkflow
from headrace.graph.workflow import WorkflowInputError
from headrace.plugins.manager import PluginError, collect


def build_parser() -> tuple[argparse.ArgumentParser, Any]:
    """The parser and its subcommands (``headrace.cli`` adds ``bench`` to them)."""
    parser = argparse.ArgumentParser(prog="headrace", description="Serve compound-AI workflows.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the daemon")
    serve.add_argument("--config", type=Path, default=os.environ.get("HEADRACE_CONFIG"),
                       help="TOML config file (default: $HEADRACE_CONFIG)")
    serve.add_argument("--host", help="server.host")
    serve.add_argument("--port", type=int, help="server.port")
    serve.add_argument("--api-key", help="server.api_key (or HEADRACE_API_KEY)")
    serve.add_argument("--data-dir", help="data.dir")
    serve.add_argument("--log-level", help="server.log_level")
    run = sub.add_parser("run", help="run a workflow in this process and print its result and node timings")
    run.add_argument("workflow")
    run.add_argument("--input", action="append", default=[], metavar="KEY=VALUE",
                     help="a workflow input (JSON, or @file for a file's text); repeat a key for a list")
    run.add_argument("--config", type=Path, help="the run's config as a JSON file")
    run.add_argument("--daemon-config", type=Path, default=os.environ.get("HEADRACE_CONFIG", "configs/default.toml"),
                     help="the engines to load (default: $HEADRACE_CONFIG or configs/default.toml)")
    prof = sub.add_parser("profile", help="measure an engine's max efficient batch size")
    prof.add_argument("engine")
    prof.add_argument("--max-batch", type=int, default=256, help="largest batch size to try")
    prof.add_argument("--daemon-config", type=Path, default=os.environ.get("HEADRACE_CONFIG", "configs/default.toml"))
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
    ingest.add_argument("--no-progress", action="store_true", help="no progress bar")
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
        if args.command in ("run", "profile"):
            return _local(args)
        if args.command == "ingest":
            return _ingest(args)
        return _serve(args)
    except (ConfigError, PluginError, WorkflowInputError, UnknownWorkflow, UnknownCollection) as exc:
        print(f"headrace: {exc}", file=sys.stderr)
        return 2
    except BaseExceptionGroup as group:  # raised through a task group: report the cause
        cause = first_error(group)
        if isinstance(cause, (ConfigError, PluginError, WorkflowInputError, UnknownWorkflow, UnknownCollection)):
            print(f"headrace: {cause}", file=sys.stderr)
            return 2
        raise


def _local(args: argparse.Namespace) -> int:
    import anyio

    from headrace.daemon import local

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level="WARNING")
    config = load_config(args.daemon_config)
    if args.command == "profile":
        if args.engine not in {e.name for e in config.engines}:
            raise ConfigError("engine", f"no engine named {args.engine!r} in {args.daemon_config}")
        return anyio.run(local.profile, config, args.engine, args.max_batch)
    run_config = {}
    if args.config is not None:
        try:
            run_config = json.loads(args.config.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError("--config", f"{args.config}: {exc}") from None
    return anyio.run(local.run_workflow, config, args.workflow, args.input, run_config)


def _ingest(args: argparse.Namespace) -> int:
    from headrace.daemon.ingest import IngestError, ingest

    try:
        return ingest(args.collection, args.paths, args.url, args.api_key, progress=not args.no_progress,
                      settings={"chunk_size": args.chunk_size, "chunk_overlap": args.chunk_overlap,
                                "embedding_model": args.embedding_model})
    except IngestError as exc:
        print(f"headrace ingest: {exc}", file=sys.stderr)
        return exc.status


def _plugins() -> int:
    registry = collect()
    for plugin, hooks in sorted(registry.by_plugin.items()):
        print(plugin)
        for hook, names in sorted(hooks.items()):
            print(f"  {hook}: {', '.join(names)}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models come from disk, never a hub
    config = load_config(
        args.config,
        overrides={"server.host": args.host, "server.port": args.port, "server.api_key": args.api_key,
                   "data.dir": args.data_dir, "server.log_level": args.log_level},
    )
    if not config.engines:
        raise ConfigError("engines", "no engines configured; pass --config configs/default.toml")
    logging.basicConfig(level=config.server.log_level.upper() if config.server.log_level != "trace" else "DEBUG",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from headrace.daemon.app import create_app
    from headrace.daemon.lifecycle import DrainingServer

    app = create_app(config)  # builds every engine (not loading yet): bad models fail here
    # The drain (server.drain_seconds) has let in-flight work finish before uvicorn shuts down;
    # its own grace period then only covers the last writes of requests the drain cut short.
    server = DrainingServer(
        uvicorn.Config(app, host=config.server.host, port=config.server.port, log_level=config.server.log_level,
                       timeout_graceful_shutdown=5),
        app.state.lifecycle,
    )
    server.run()
    return server.exit_status


if __name__ == "__main__":
    sys.exit(main())
