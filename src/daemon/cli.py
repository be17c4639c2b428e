"""The ``headrace`` command: serve, plugins, version."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Sequence

from headrace import __version__
from headrace.daemon.config import ConfigError, load_config
from headrace.plugins.manager import PluginError, collect


def _parser() -> argparse.ArgumentParser:
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
    sub.add_parser("plugins", help="list the loaded plugins and what each registers")
    sub.add_parser("version", help="print the version")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "version":
            print(f"headrace {__version__}")
            return 0
        if args.command == "plugins":
            return _plugins()
        return _serve(args)
    except (ConfigError, PluginError) as exc:
        print(f"headrace: {exc}", file=sys.stderr)
        return 2


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

    app = create_app(config)  # builds every engine (not loading yet): bad models fail here
    uvicorn.run(app, host=config.server.host, port=config.server.port, log_level=config.server.log_level,
                timeout_graceful_shutdown=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
