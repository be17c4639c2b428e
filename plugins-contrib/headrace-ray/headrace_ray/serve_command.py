"""``headrace-ray serve``: deploy the application on a Ray cluster (or a local one) and block."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading
from typing import Sequence

from headrace_ray.deployment import ServeRayArgs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="headrace-ray", description="Serve headrace on Ray Serve.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="deploy N headrace replicas behind the affinity router; SIGINT or "
                                         "SIGTERM shuts Serve down (to leave it running, use serve deploy serve.yaml)")
    serve.add_argument("--address", default=None,
                       help="the Ray cluster to join (e.g. auto, or ray://head:10001); default: start a local one")
    serve.add_argument("--host", default="127.0.0.1", help="Serve's HTTP host")
    serve.add_argument("--port", type=int, default=8000, help="Serve's HTTP port")
    defaults = ServeRayArgs()
    for f in dataclasses.fields(ServeRayArgs):
        if f.name == "overrides":
            continue
        kind = {"int": int, "float": float}.get(str(f.type), str)
        serve.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=getattr(defaults, f.name),
                           help=f"(default: {getattr(defaults, f.name)!r})")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import ray
    from ray import serve

    from headrace_ray.deployment import build_app

    settings = ServeRayArgs(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServeRayArgs)
                               if f.name != "overrides"})
    ray.init(address=args.address)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_app(settings), name="headrace", route_prefix="/")
    scale = (f"{settings.min_replicas}-{settings.max_replicas} replicas, autoscaled" if settings.max_replicas
             else f"{settings.replicas} replicas")
    print(f"headrace-ray: serving on http://{args.host}:{args.port} ({scale})", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # either one: Serve stops the replicas, their daemons end
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
