"""The command line's manners (issue 31 item 5): --version/-V, --debug on either side of the
command, examples in every --help, shell completion, progress bars with rate and ETA on a
terminal only (bench disk saying where it saved its profile: test_bench_disk.py)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from importlib.metadata import version

import pytest

from offload_engine import __version__
from offload_engine.cli import main as cli
from offload_engine.cli.main import build_parser, main
from offload_engine.formats.errors import FormatError

from helpers.paths import FIXTURES
from helpers.terminal import assert_bar, terminal

DS_RUN = os.path.join(FIXTURES, "deepspeed", "zero2_w3_fp32")
IMPORT_RUN = os.path.join(FIXTURES, "deepspeed_import", "zero3_w2_fp32_adamw")


# --- 1. --version / -V ----------------------------------------------------------------

@pytest.mark.parametrize("flag", ["-V", "--version"])
def test_version_names_ours_torch_and_python(flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([flag])
    assert exit_.value.code in (0, None)
    out = capsys.readouterr().out
    assert f"offload-engine {__version__}" in out
    assert f"torch {version('torch')}" in out
    assert f"Python {sys.version_info.major}.{sys.version_info.minor}" in out


# --- 2. --debug before or after the command -------------------------------------------

@pytest.mark.parametrize("argv", [["--debug", "inspect", "/no/such/ckpt"],
                                  ["inspect", "/no/such/ckpt", "--debug"],
                                  ["inspect", "--debug", "/no/such/ckpt"]])
def test_debug_on_either_side_shows_the_error_itself(argv):
    with pytest.raises(FormatError, match="/no/such/ckpt"):
        main(argv)


def test_without_debug_the_error_is_one_line(capsys):
    assert main(["inspect", "/no/such/ckpt"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_debug_after_a_nested_command_parses():
    args = build_parser("config").parse_args(
        ["config", "from-deepspeed", "ds_config.json", "--debug"])
    assert args.debug is True
    assert build_parser("config").parse_args(
        ["config", "from-deepspeed", "ds_config.json"]).debug is False


# --- 3. examples in every --help ------------------------------------------------------

def all_commands():
    parser = build_parser()
    return parser, [((), parser)] + list(cli.subparsers_of(parser))


def completion_script(shell: str) -> str:
    from offload_engine.cli.completion import completion_script

    return completion_script(shell)


def test_every_command_help_ends_with_examples():
    _, commands = all_commands()
    missing = [" ".join(words) or "(top level)" for words, p in commands
               if "\nexamples:\n  # " not in p.format_help()]
    assert not missing, f"no examples in --help of: {missing}"


def test_every_example_parses_with_the_real_parser_and_fits_80_columns():
    from offload_engine.cli.examples import EXAMPLES, WIDTH, examples_text

    parser = build_parser()
    for words, rows in EXAMPLES.items():
        for line in examples_text(words).splitlines():
            assert len(line) <= WIDTH, line
        for _, command in rows:
            argv = shlex.split(command.split(" > ")[0])
            assert argv[0] == "offload-engine" and tuple(argv[1:1 + len(words)]) == words
            parser.parse_args(argv[1:])  # argparse exits on an unknown option or bad value


def test_examples_keep_their_lines_while_the_description_still_wraps():
    _, commands = all_commands()
    help_text = dict(commands)[("import", "deepspeed")].format_help()
    examples = help_text.split("examples:\n", 1)[1]
    assert "  offload-engine import deepspeed ds_run/ ckpt/ --world-size 8\n" in examples
    assert max(len(line) for line in help_text.splitlines()) <= 100


# --- 4. shell completion --------------------------------------------------------------

def test_bash_completion_names_every_subcommand():
    script = completion_script("bash")
    _, commands = all_commands()
    for words, _ in commands[1:]:
        assert re.search(rf"\b{re.escape(words[-1])}\b", script), words
    assert "--max-shard-size" in script and "--world-size" in script


def test_zsh_completion_is_a_compdef():
    assert completion_script("zsh").startswith("#compdef offload-engine")


@pytest.mark.multiprocess
@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash here")
def test_bash_completes_a_command_and_an_option(tmp_path):
    script = tmp_path / "offload-engine.bash"
    script.write_text(completion_script("bash"))
    probe = (f"source {shlex.quote(str(script))}\n"
             "complete -p offload-engine >/dev/null || exit 3\n"
             "fn=$(complete -p offload-engine | sed -E 's/.*-F ([^ ]+).*/\\1/')\n"
             "COMP_WORDS=(offload-engine con); COMP_CWORD=1; COMP_LINE='offload-engine con'\n"
             "COMP_POINT=${#COMP_LINE}; $fn offload-engine con offload-engine\n"
             "echo \"cmd: ${COMPREPLY[*]}\"\n"
             "COMP_WORDS=(offload-engine consolidate --max); COMP_CWORD=2\n"
             "COMP_LINE='offload-engine consolidate --max'; COMP_POINT=${#COMP_LINE}\n"
             "$fn offload-engine --max consolidate\n"
             "echo \"opt: ${COMPREPLY[*]}\"\n")
    done = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "cmd: config consolidate" in done.stdout or "cmd: consolidate config" in done.stdout
    assert "opt: --max-shard-size" in done.stdout


# --- 5. progress with rate and ETA, on a terminal only --------------------------------

def test_export_draws_a_bar_on_a_terminal(tmp_path, monkeypatch):
    stderr = terminal(monkeypatch)
    assert main(["export", DS_RUN, "emb.weight", "--out", str(tmp_path / "e.npy")]) == 0
    assert_bar(stderr.getvalue(), "export")


def test_diff_draws_a_bar_on_a_terminal(monkeypatch):
    stderr = terminal(monkeypatch)
    assert main(["diff", DS_RUN, DS_RUN]) == 0
    assert_bar(stderr.getvalue(), "diff")


def test_import_draws_a_bar_on_a_terminal(tmp_path, monkeypatch):
    stderr = terminal(monkeypatch)
    assert main(["import", "deepspeed", IMPORT_RUN, str(tmp_path / "ckpt"),
                 "--world-size", "2"]) == 0
    text = stderr.getvalue()
    assert_bar(text, "import")
    assert "2/2" in text and "written" in text


def test_no_bar_with_json(tmp_path, monkeypatch, capsys):
    stderr = terminal(monkeypatch)
    assert main(["export", DS_RUN, "emb.weight", "--out", str(tmp_path / "a.npy"),
                 "--json"]) == 0
    assert main(["diff", DS_RUN, DS_RUN, "--json"]) == 0
    assert stderr.getvalue() == ""
    json.loads(capsys.readouterr().out.split("\n}\n")[0] + "\n}")


def test_no_bar_when_stderr_is_not_a_terminal(tmp_path, capsys):
    assert main(["export", DS_RUN, "emb.weight", "--out", str(tmp_path / "a.npy")]) == 0
    assert capsys.readouterr().err == ""
