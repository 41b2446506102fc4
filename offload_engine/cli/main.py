"""`offload-engine` command line: one module per subcommand, each with ``add_parser`` and ``run``.

Exit codes: 0 success, 1 a check failed (e.g. diff found differences), 2 bad input or usage,
70 an internal error (a bug), 130 interrupted, 141 the reader of stdout went away.

Errors the user can act on print one line to stderr, no traceback (``--debug`` shows it):
the project's own errors (``errors.OffloadEngineError``: bad input, a full disk, a second
writer) and the operating system refusing a named path (``OSError`` with a file name and
an errno of the machine's state: missing, not permitted, full, read-only...). Anything else
is a bug in offload-engine: its traceback is shown with a line asking to report it, so it
is never mistaken for a user's mistake.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import sys
import traceback

from .. import __version__
from ..errors import InputError, OffloadEngineError
from .examples import add_examples
from .printable import printable

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
    "completion": "completion",
}


EXIT_USER_ERROR = 2
EXIT_INTERNAL_ERROR = 70  # sysexits' EX_SOFTWARE: an internal software error
EXIT_INTERRUPTED = 130
EXIT_CLOSED_PIPE = 141

# errnos that describe the machine or the path the user named, not our code
_ENVIRONMENT_ERRNOS = frozenset({
    errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.EROFS,
    errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ENOTEMPTY, errno.ENAMETOOLONG,
    errno.ELOOP, errno.EIO, errno.EMFILE, errno.ENFILE, errno.EXDEV, errno.EBUSY,
    errno.ETXTBSY, errno.EFBIG, errno.ENXIO, errno.ENODEV, errno.EINVAL,
})


class UserError(InputError):
    """An error caused by input the user gave: printed as one line, exit code 2."""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``only``, just that subcommand's module is imported (each pulls in
    torch and more: a command should not pay for the imports of all the others)."""
    parser = argparse.ArgumentParser(
        prog="offload-engine",
        description="Optimizer-state offload engine: benchmarks, checkpoint tools and the demo.")
    parser.add_argument("--debug", action="store_true",
                        help="show tracebacks and debug logs (before or after the command)")
    parser.add_argument("-V", "--version", action=_VersionAction,
                        help="print the versions of offload-engine, torch and Python")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name)  # listed, not loaded: this run does not use it
            continue
        mod = importlib.import_module(f"offload_engine.cli.{module}")
        mod.add_parser(sub)
    for path, command in subparsers_of(parser):
        # --debug after the command too ("offload-engine inspect X --debug"); SUPPRESS keeps
        # a subcommand from resetting a --debug given before it. Hidden: the top-level help
        # lists it once.
        if "--debug" not in command._option_string_actions:
            command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                 help=argparse.SUPPRESS)
        add_examples(command, path)
    add_examples(parser, ())
    return parser


def subparsers_of(parser: argparse.ArgumentParser, path: tuple = ()):
    """(command words, parser) of every subcommand under ``parser``, depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, command in action.choices.items():
                yield path + (name,), command
                yield from subparsers_of(command, path + (name,))


def version_text() -> str:
    """The versions a bug report needs, read from the installed packages' metadata (torch is
    not imported: that takes seconds)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    return (f"offload-engine {__version__} (torch {torch_version}, "
            f"Python {platform.python_version()})")


class _VersionAction(argparse.Action):
    """``-V``/``--version``: print :func:`version_text` and exit 0; computed only when asked."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())  # to stdout, as argparse's own version action
        parser.exit()


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
    asks_version = "--version" in argv or "-V" in argv
    parser = build_parser(only="" if command is None and asks_version else command)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.run(args) or 0)
    except BrokenPipeError:
        return _closed_pipe()
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - sorted into the user's and ours just below
        if args.debug:
            raise
        if is_user_facing(e):
            # one line: a name or path from the input may hold a newline or ESC
            print(f"offload-engine {args.command}: error: {printable(e)}", file=sys.stderr)
            return EXIT_USER_ERROR
        traceback.print_exc()
        print(f"offload-engine {args.command}: internal error ({type(e).__name__}): this is a "
              f"bug in offload-engine, not in your input; please report it with the "
              f"traceback above and the command you ran", file=sys.stderr)
        return EXIT_INTERNAL_ERROR


def is_user_facing(error: BaseException) -> bool:
    """True for an error the user can act on, printed as one line: one of the project's
    own, or the operating system refusing a path the user named (it carries the file name
    and an errno that describes the machine, not our code)."""
    if isinstance(error, OffloadEngineError):
        return True
    return (isinstance(error, OSError) and error.filename is not None
            and error.errno in _ENVIRONMENT_ERRNOS)


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
