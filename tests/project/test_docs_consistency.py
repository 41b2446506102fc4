"""The docs cannot drift from the code unnoticed: help text, links, named files, timings.

- Every code block that starts with ``usage: offload-engine`` is the command's real
  ``--help`` (COLUMNS=80, so argparse wraps as in the docs), and every command has one.
- Options on documented ``offload-engine`` command lines exist.
- Relative links resolve to a file, and ``#anchor`` to one of its headings (GitHub's slugs);
  a ``.md`` file named in prose, or a file of this repository, exists.
- Timings say where they came from: a line of prose that states a duration sits in a
  section (the text under its nearest heading) that has a provenance paragraph, either
  ``Measured: MACHINE, `COMMAND` ...`` for a figure timed on a machine, or
  ``Computed: ... `COMMAND` ...`` for one a command calculates (plan's predictions).
  Code blocks are exempt: they are commands or what a command printed.
"""

from __future__ import annotations

import functools
import glob
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

from helpers.paths import ROOT

DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [os.path.join(ROOT, "README.md")]


@dataclass
class Block:
    line: int    # line number of the opening fence
    text: str    # the content, without the fences


@dataclass
class Doc:
    path: str
    blocks: list        # fenced code blocks
    prose: list         # (line number, text) of every line outside code blocks

    @property
    def name(self) -> str:
        return os.path.relpath(self.path, ROOT)


@functools.cache
def parse(path: str) -> Doc:
    """Split a markdown file into fenced code blocks and prose. An unclosed fence fails: on
    GitHub it swallows the rest of the page (and would hide that text from these checks)."""
    blocks, prose, fence, body = [], [], None, []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if fence is None:
                if re.match(r" {0,3}```", line):
                    fence, body = n, []
                else:
                    prose.append((n, line.rstrip("\n")))
            elif re.fullmatch(r"\s*```+\s*", line):
                blocks.append(Block(fence, "".join(body)))
                fence = None
            else:
                body.append(line)
    assert fence is None, f"{path}:{fence}: code block never closed"
    return Doc(path, blocks, prose)


def test_code_fences_are_closed():
    for path in DOCS:
        parse(path)  # asserts


# --- command help -----------------------------------------------------------------------

USAGE = "usage: offload-engine"
WORD = re.compile(r"[a-z][a-z0-9-]*")


@functools.cache
def cli_help(words: tuple) -> str:
    """What `offload-engine WORDS --help` prints at 80 columns (the parser's prog is
    "offload-engine" however it is started)."""
    done = subprocess.run([sys.executable, "-m", "offload_engine.cli.main", *words, "--help"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "COLUMNS": "80", "NO_COLOR": "1"})
    assert done.returncode == 0, f"offload-engine {' '.join(words)} --help: {done.stderr}"
    return done.stdout


def subcommands(help_text: str) -> list[str]:
    """The subcommands a help text lists: argparse indents them by exactly four spaces."""
    return re.findall(r"^    ([a-z][a-z0-9-]*)(?:\s|$)", help_text, re.M)


@functools.cache
def command_tree() -> frozenset:
    """Every command path, () for the top level, walked through the real help."""
    paths, todo = set(), [()]
    while todo:
        path = todo.pop()
        paths.add(path)
        todo += [path + (w,) for w in subcommands(cli_help(path))]
    return frozenset(paths)


def usage_blocks():
    """(doc path, block, command words) of every block that starts with the usage line."""
    found = []
    for path in DOCS:
        for block in parse(path).blocks:
            if block.text.startswith(USAGE):
                words = []
                for token in block.text.split("\n", 1)[0].split()[2:]:
                    if not WORD.fullmatch(token):
                        break
                    words.append(token)
                found.append((path, block, tuple(words)))
    return found


# The blocks are argparse's rendering on Python 3.11 and 3.12; from 3.13 an option with
# aliases shows its metavar once ("--generation, --tag G"), so the text differs by Python.
@pytest.mark.multiprocess
@pytest.mark.skipif(sys.version_info[:2] not in ((3, 11), (3, 12)),
                    reason="the docs show the help as argparse of Python 3.11/3.12 prints it")
@pytest.mark.parametrize("path, block, words", [
    pytest.param(*found, id=f"{os.path.relpath(found[0], ROOT)}:{found[1].line}")
    for found in usage_blocks()])
def test_usage_block_is_the_real_help(path, block, words):
    real = cli_help(words)
    assert block.text == real, (
        f"{path}:{block.line} is not what `COLUMNS=80 offload-engine "
        f"{' '.join(words + ('--help',))}` prints; paste its output")


@pytest.mark.multiprocess
def test_every_command_has_its_help_in_the_docs():
    documented = {words for _, _, words in usage_blocks()}
    missing = sorted(command_tree() - documented)
    assert not missing, ("no `usage: offload-engine ...` block for: "
                         + ", ".join("offload-engine " + " ".join(m) for m in missing))


INVOCATION = re.compile(r"(?:\$ )?(?:\S*/)?offload-engine(?=\s|$)(.*)")
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def invocations(doc: Doc):
    """(line, words, text) of each `offload-engine ...` command line in code blocks, with
    its indented continuation lines (a synopsis wraps that way)."""
    tree = command_tree()
    for block in doc.blocks:
        lines = block.text.splitlines()
        for i, line in enumerate(lines):
            m = INVOCATION.match(line)
            if not m:
                continue
            tokens = m.group(1).split()
            if tokens and tokens[0].endswith(":"):
                continue  # "offload-engine inspect: error: ...": output, not a command
            words = ()
            for token in tokens:
                if words + (token,) not in tree:
                    break
                words += (token,)
            text = m.group(1)
            for more in lines[i + 1:]:
                if not more[:1].isspace():
                    break
                text += " " + more
            yield block.line + 1 + i, words, text


@pytest.mark.multiprocess
def test_documented_command_lines_use_real_options():
    bad = []
    top = set(OPTION.findall(cli_help(())))
    for path in DOCS:
        doc = parse(path)
        for line, words, text in invocations(doc):
            known = top | set(OPTION.findall(cli_help(words)))
            for option in sorted(set(OPTION.findall(text)) - known):
                bad.append(f"{doc.name}:{line}: offload-engine {' '.join(words)} has no {option}")
    assert not bad, "\n".join(bad)


# --- links and file names ---------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"`[^`]*`")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation other than - and _ removed,
    each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache
def anchors(path: str) -> frozenset:
    seen, out = {}, set()
    for _, line in parse(path).prose:
        m = re.match(r" {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")  # GitHub numbers repeated headings
    return frozenset(out)


def test_slug_follows_github():
    assert slug("`offload-engine bench io`") == "offload-engine-bench-io"
    assert slug("Llama-2-70B on 64 GPUs (8 nodes), fp32") == "llama-2-70b-on-64-gpus-8-nodes-fp32"
    assert slug("Array metadata (`zarr.json`)") == "array-metadata-zarrjson"
    assert slug("Speed: a/b_c") == "speed-ab_c"


def test_relative_links_resolve():
    bad = []
    for path in DOCS:
        doc = parse(path)
        for n, line in doc.prose:
            for target in LINK.findall(CODE_SPAN.sub("", line)):
                if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):
                    continue  # http:, https:, mailto:
                file, _, anchor = target.partition("#")
                dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
                if not os.path.exists(dest):
                    bad.append(f"{doc.name}:{n}: {target}: no file {os.path.relpath(dest, ROOT)}")
                elif anchor and (not dest.endswith(".md") or anchor not in anchors(dest)):
                    bad.append(f"{doc.name}:{n}: {target}: no heading #{anchor} in "
                               f"{os.path.relpath(dest, ROOT)}")
    assert not bad, "\n".join(bad)


PATH_MENTION = re.compile(r"(?<![\w/.$~-])((?:[a-z_][\w.-]*/)+[\w.-]+\.(?:md|py))(?![\w/])")


def test_files_named_in_prose_exist():
    """A document the reader is sent to, or a file of this repository named by its path,
    is one the reader has: `tools/bench_io.py`, `optim/comm.py` (in the package), and no
    `notes/x.md` that lives elsewhere. Paths into other projects (torch/optim/_muon.py)
    are not this repository's and are not checked."""
    package = os.path.join(ROOT, "offload_engine")
    ours = set(os.listdir(ROOT)) | set(os.listdir(package))
    bad = []
    for path in DOCS:
        doc = parse(path)
        for n, line in doc.prose:
            for name in PATH_MENTION.findall(line):
                if not name.endswith(".md") and name.split("/")[0] not in ours:
                    continue
                bases = (ROOT, os.path.dirname(path), package)
                if not any(os.path.exists(os.path.join(b, name)) for b in bases):
                    bad.append(f"{doc.name}:{n}: {name} is not in this repository")
    assert not bad, "\n".join(bad)


# --- timings ----------------------------------------------------------------------------

DURATION = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?(?:ms|µs|us|ns|s|sec|seconds?|min|minutes?"
                      r"|h|hours?)(?!\w)")
# an option and its value (`--timeout 600`, `--step-time 2s`) is not a timing
OPTION_VALUE = re.compile(r"--[\w-]+(?:[ =](?!-)[^\s`|)\]]+)?")
MEASURED = re.compile(r"Measured: [^`]*\w[^`]*`[^`]+`")
COMPUTED = re.compile(r"Computed: [^`]*`[^`]+`")


def states_duration(line: str) -> bool:
    return bool(DURATION.search(OPTION_VALUE.sub("", line)))


def sections(doc: Doc):
    """(heading, [(line number, text)]) for the text under each heading, the heading's own
    line included; text before the first heading is a section too."""
    heading, lines = "(top of the file)", []
    for n, line in doc.prose:
        if re.match(r" {0,3}#{1,6}\s", line):
            yield heading, lines
            heading, lines = line.strip(), []
        lines.append((n, line))
    yield heading, lines


def test_duration_pattern():
    for line in ["took 1.4 s", "0.51-0.66 s", "in 35-65 ms", "about 3 minutes", "1.2s wall",
                 "3.6–7.7 s", "0.21 + 0.43 s"]:
        assert states_duration(line), line
    for line in ["3 steps", "8 MiB", "1.84 GB/s", "`--timeout 600`", "`--step-time 2s`",
                 "5 hits", "step-00000003", "runs 5-9"]:
        assert not states_duration(line), line


def test_provenance_line_form():
    assert MEASURED.match("Measured: 2-vCPU VM, 2026-11-29, `offload-engine plan --json`")
    assert not MEASURED.match("Measured: `offload-engine plan`")           # no machine
    assert not MEASURED.match("Measured: on the 2-vCPU VM")                # no command
    assert COMPUTED.match("Computed: by `offload-engine plan --model M`")


def test_every_timing_says_where_it_came_from():
    bad = []
    for path in DOCS:
        doc = parse(path)
        for heading, lines in sections(doc):
            provenance = False
            for i, (n, line) in enumerate(lines):
                if line.startswith(("Measured:", "Computed:")):
                    # the paragraph it starts: a long command wraps onto the next lines
                    text = line
                    for _, more in lines[i + 1:]:
                        if not more.strip():
                            break
                        text += " " + more.strip()
                    if not (MEASURED.match(text) or COMPUTED.match(text)):
                        bad.append(f"{doc.name}:{n}: a provenance line names the machine, then "
                                   f"the command in backticks: {line!r}")
                    provenance = True
            if provenance:
                continue
            for n, line in lines:
                if states_duration(line):
                    bad.append(f"{doc.name}:{n}: a timing in section {heading!r}, which has no "
                               f"'Measured:' (or 'Computed:') line: {line.strip()!r}")
    assert not bad, "\n".join(bad)
