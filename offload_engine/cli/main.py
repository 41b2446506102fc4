"""`offload-engine` command line: one module per subcommand, each with ``add_parser`` and ``run``.

Exit codes: 0 success, 1 a check failed (e.g. diff found differences), 2 bad input or usage.
Errors the user can act on print one line to stderr, no traceback (``--debug`` shows it).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from .. import __version__

# subcommand name -> module under offload_engine.cli
COMMANDS = {
    "demo": "demo",
    "bench": "bench",
    "consolidate": "consolidate",
    "plan": "plan",
    "inspect": "inspect",
    "diff": "diff",
    "export": "export",
    "config": "config",
    "import": "import_",
}


EXIT_CLOSED_PIPE = 141


class UserError(Exception):
    """An error caused by input the user gave: printed as one line, exit code 2."""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``only``, just that subcommand's module is imported (each pulls in
    torch and more: a command should not pay for the imports of all the others)."""
    parser = argparse.ArgumentParser(
        prog="offload-engine",
        description="Optimizer-state offload engine: benchmarks, checkpoint tools and the demo.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    parser.add_argument("--version", action="version", version=f"offload-engine {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name)  # listed, not loaded: this run does not use it
            continue
        mod = importlib.import_module(f"offload_engine.cli.{module}")
        mod.add_parser(sub)
    return parser


def _command_in(argv: list[str]) -> str | None:
    """The subcommand named in ``argv`` (skipping global flags), if any."""
    for arg in argv:
        if arg in COMMANDS:
            return arg
        if not arg.startswith("-"):
            return None
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command_in(argv)
    # --version alone loads no subcommand (each one imports numpy or torch)
    parser = build_parser(only="" if command is None and "--version" in argv else command)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.run(args) or 0)
    except BrokenPipeError:
        return _closed_pipe()
    except (UserError, OSError, ValueError) as e:
        if args.debug:
            raise
        print(f"offload-engine {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _closed_pipe() -> int:
    """The reader of stdout went away (``| head``): stop quietly, as a process killed by
    SIGPIPE would, with its exit code (128 + 13). Later writes and the final flush go to
    /dev/null instead of raising again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_CLOSED_PIPE


def entry() -> None:
    """Console-script entry: run, flush, and leave without tearing down torch's globals
    (about 0.4 s at exit that a short command like consolidate or plan should not pay).
    Every command has finished its work and cleaned up before ``main`` returns."""
    rc = main()
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # the last buffered lines found the pipe closed
        rc = _closed_pipe()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
