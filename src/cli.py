"""The ``headrace`` command: the daemon's subcommands, plus ``bench``, the harness that drives a daemon."""

from __future__ import annotations

from typing import Sequence

from headrace.bench import subcommand as bench_cli
from headrace.daemon import commands as daemon_cli


def main(argv: Sequence[str] | None = None) -> int:
    parser, sub = daemon_cli.build_parser()
    bench_cli.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "bench":
        return bench_cli.run(args)
    return daemon_cli.dispatch(args)


if __name__ == "__main__":
    raise SystemExit(main())
