"""The command line's two kinds of failure: the project's own errors (and the operating
system refusing a path the user named) are one line on stderr and exit 2; anything else is a
bug in offload-engine, shown with its traceback and a request to report it (exit 70).

In-process through ``cli.main.main`` so the fast loop covers it; the subcommand's ``run`` is
replaced only to plant a failure that no input can produce (a bug)."""

from __future__ import annotations

import errno
import os

import pytest

from offload_engine import errors
from offload_engine.cli import diff as diff_cli
from offload_engine.cli import main as cli


def run_cli(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_input_error_from_a_real_command_is_one_line_exit_2(tmp_path, capsys):
    """Random bytes where a checkpoint should be: the reader's FormatError is one line."""
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(os.urandom(4096))
    code, _, err = run_cli(["inspect", str(junk)], capsys)
    assert code == cli.EXIT_USER_ERROR == 2
    assert "Traceback" not in err
    assert err.startswith("offload-engine inspect: error: ")
    assert len(err.strip().splitlines()) == 1
    assert str(junk) in err


def test_missing_path_is_one_line_exit_2(tmp_path, capsys):
    code, _, err = run_cli(["inspect", str(tmp_path / "nowhere")], capsys)
    assert code == 2
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("error", [
    errors.InputError("the flag --size must be positive"),
    errors.UsageError("the store is closed"),
    errors.PathExistsError("out/: a checkpoint of step 3 is already committed"),
    OSError(errno.ENOSPC, "No space left on device", "/nvme/c/0"),
    PermissionError(errno.EACCES, "Permission denied", "/root/secret"),
])
def test_user_facing_errors_print_one_line(monkeypatch, capsys, error):
    def run(args):
        raise error
    monkeypatch.setattr(diff_cli, "run", run)
    code, _, err = run_cli(["diff", "a", "b"], capsys)
    assert code == 2
    assert "Traceback" not in err
    assert err.strip() == f"offload-engine diff: error: {error}"


@pytest.mark.parametrize("error", [
    KeyError("chunks"),                      # a field our own code forgot to write
    ValueError("not enough values to unpack"),  # a builtin ValueError is not input's fault
    TypeError("unsupported operand"),
    OSError(errno.EBADF, "Bad file descriptor"),  # no path: our descriptor bookkeeping
    AttributeError("'NoneType' object has no attribute 'close'"),
])
def test_anything_else_is_a_bug_with_its_traceback(monkeypatch, capsys, error):
    def planted_bug(args):
        raise error
    monkeypatch.setattr(diff_cli, "run", planted_bug)
    code, _, err = run_cli(["diff", "a", "b"], capsys)
    assert code == cli.EXIT_INTERNAL_ERROR == 70
    assert "Traceback (most recent call last):" in err
    assert "planted_bug" in err  # the frame where it happened is shown
    last = err.strip().splitlines()[-1]
    assert last.startswith("offload-engine diff: internal error")
    assert "bug in offload-engine" in last and "report" in last


def test_debug_flag_reraises_a_user_error(monkeypatch):
    def run(args):
        raise errors.InputError("bad")
    monkeypatch.setattr(diff_cli, "run", run)
    with pytest.raises(errors.InputError):
        cli.main(["--debug", "diff", "a", "b"])


def test_every_error_class_of_the_package_has_the_root():
    """No public exception class defined in offload_engine escapes the root (a new one that
    forgets it would be shown to users as an internal error). Private ones (``_Stop``,
    ``_DirectRefused``) are control flow inside one module and never leave it."""
    import importlib
    import pkgutil

    import offload_engine
    found = []
    for info in pkgutil.walk_packages(offload_engine.__path__, "offload_engine."):
        if info.name.endswith("zarr_bfloat16"):
            continue  # loaded through layout/zarr_registration (importing it first is a cycle)
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if (isinstance(value, type) and issubclass(value, BaseException)
                    and value.__module__ == module.__name__
                    and not value.__name__.startswith("_")):
                found.append(value)
    assert len(found) >= 20
    rootless = [f"{c.__module__}.{c.__qualname__}" for c in found
                if not issubclass(c, errors.OffloadEngineError)]
    assert rootless == []
