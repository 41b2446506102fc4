"""`offload-engine` command line: one module per subcommand, each with ``add_parser`` and ``run``.

Exit codes: 0 success, 1 a check failed (e.g. diff found differences), 2 bad input or usage.
Errors the user can act on print one line to stderr, no traceback (``--debug`` shows it).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand name -> module under offload_engine.cli
COMMANDS = {
    "demo": "demo",
    "bench": "bench",
    "consolidate": "consolidate",
    "plan": "plan",
    "inspect": "inspect",
    "diff": "diff",
    "export": "export",
}


class UserError(Exception):
    """An error caused by input the user gave: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="offload-engine",
        description="Optimizer-state offload engine: benchmarks, checkpoint tools and the demo.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        try:
            mod = importlib.import_module(f"offload_engine.cli.{module}")
        except ModuleNotFoundError as e:
            if e.name == f"offload_engine.cli.{module}":
                continue  # subcommand not built yet
            raise
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.run(args) or 0)
    except (UserError, OSError, ValueError) as e:
        if args.debug:
            raise
        print(f"offload-engine {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
