"""The shell commands and Python snippets of README.md and docs/*.md, and a check of what a
command printed against what the doc shows (no tests here; tests/project/test_docs_commands.py
runs them).

What counts as a command, in a fenced code block:

- ```` ```bash ````, ```` ```sh ````, ```` ```shell ````: the whole block, run as one script;
- ```` ```console ```` and untagged blocks: a line starting with ``$ `` is a command; the lines
  after it, up to the next ``$ ``, are what it printed; ``$ echo $?`` followed by a number is
  the exit code the previous command must give (else 0);
- an untagged or ```` ```text ```` block whose first line that is not a comment starts like
  a command (``offload-engine``, ``python``, ``torchrun``, ``./``, ...), without ``$ ``, is
  a block of commands too (tag it ```` ```bash ````), unless that line is a synopsis:
  options in brackets (``offload-engine bench io --path DIR [--size SIZE]``), not meant to be
  run.

```` ```python ````, ```` ```json ````, ```` ```yaml ```` blocks are never commands.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from helpers.paths import ROOT

SHELL = {"bash", "sh", "shell"}
NOT_SHELL = {"python", "json", "yaml", "toml", "diff"}
SYNOPSIS = re.compile(r"\[--?[\w-]")
COMMAND_START = re.compile(r"(?:\./|\.venv/bin/|python3?\s|torchrun\s|accelerate\s|pip\s|"
                           r"offload-engine(?:\s|$)|bash\s|cd\s)")
# the paths the docs write under; a command gets them under its run's own folder
DOC_TMP = "/tmp/"
DOC_ROOT = "/work/main"


@dataclass
class Block:
    doc: str     # path relative to the repository
    line: int    # line number of the opening fence
    lang: str    # the fence's tag, "" when untagged
    text: str


@dataclass
class Command:
    doc: str
    line: int                 # line number of the command in the doc
    text: str                 # as written, continuation lines joined
    shown: list = field(default_factory=list)   # the output lines the doc shows
    exit_code: int = 0        # from a following `$ echo $?`

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def doc_paths() -> list[str]:
    """README.md and docs/*.md, relative to the repository."""
    docs = sorted(f for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    return ["README.md"] + [f"docs/{f}" for f in docs]


def blocks(doc: str) -> list[Block]:
    found, fence, body = [], None, []
    with open(os.path.join(ROOT, doc)) as f:
        for n, line in enumerate(f, 1):
            if fence is None:
                m = re.match(r" {0,3}```\s*([\w+-]*)", line)
                if m:
                    fence, body = (n, m.group(1).lower()), []
            elif re.fullmatch(r"\s*```+\s*", line):
                found.append(Block(doc, fence[0], fence[1], "".join(body)))
                fence = None
            else:
                body.append(line)
    return found


def logical_lines(text: str, first: int):
    """(line number, line) with backslash continuations joined."""
    pending, start = "", None
    for i, line in enumerate(text.splitlines()):
        if start is None:
            start = first + i
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending, start = "", None
    if start is not None:
        yield start, pending


def looks_like_commands(block: Block) -> bool:
    """A block with no `$ ` prompt whose first real line starts like a command and is not a
    synopsis."""
    for line in block.text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            # "offload-engine demo: ..." is what a command printed
            return (bool(COMMAND_START.match(line)) and not re.match(r"\S+ \S+:", line)
                    and not SYNOPSIS.search(line))
    return False


def commands(block: Block) -> list[Command]:
    first = block.line + 1
    if block.lang in NOT_SHELL or (block.lang == "text" and not looks_like_commands(block)):
        return []
    if block.lang in SHELL or (block.lang in ("", "text") and "\n$ " not in "\n" + block.text
                               and looks_like_commands(block)):
        # the whole block is one script: a quoted argument may span lines
        return [Command(block.doc, first, block.text.strip())] if block.text.strip() else []
    found = []
    lines = list(logical_lines(block.text, first))
    i = 0
    while i < len(lines):
        n, line = lines[i]
        i += 1
        if not line.startswith("$ "):
            if found:
                found[-1].shown.append(line)
            continue
        text = line[2:].strip()
        if text == "echo $?" and found and i < len(lines) and lines[i][1].strip().isdigit():
            found[-1].exit_code = int(lines[i][1])
            i += 1
            continue
        found.append(Command(block.doc, n, text))
    return found


def all_commands() -> list[Command]:
    return [c for doc in doc_paths() for b in blocks(doc) for c in commands(b)]


def python_blocks() -> list[Block]:
    return [b for doc in doc_paths() for b in blocks(doc) if b.lang == "python"]


# --- running and comparing ---------------------------------------------------------------

def localize(command: str, work: str) -> str:
    """The command with the doc's /tmp/ paths moved under ``work``/tmp/."""
    return command.replace(DOC_TMP, os.path.join(work, "tmp") + "/")


def normalize_shown(line: str) -> str:
    return line.replace(DOC_ROOT, "<ROOT>").replace(DOC_TMP, "<TMP>/").rstrip()


def normalize_real(line: str, work: str) -> str:
    line = line.replace(os.path.join(work, "tmp") + "/", "<TMP>/")
    for root in {os.path.realpath(ROOT), ROOT, work}:
        line = line.replace(root, "<ROOT>")
    return line.rstrip()


FRACTION = re.compile(r"[-+]?\d*\.\d+(?:e[-+]?\d+)?")


def skeleton(line: str) -> str:
    """The line with every number that has a fraction (a loss, a size in KiB, a rate) a `#`
    and runs of spaces one: what stays from run to run and machine to machine (headers,
    units, field names, counts of bytes and steps)."""
    return re.sub(r"\s+", " ", FRACTION.sub("#", line)).strip()


def missing_lines(shown: list[str], real: str, work: str, loose: str | None = None) -> list[str]:
    """The doc's shown lines that the real output lacks. A line of `...` is an elision and
    `...` inside a line matches anything; a shown line that ``loose`` (a regex) matches is
    compared by its skeleton only (``""``: every line)."""
    exact = [normalize_real(x, work) for x in real.splitlines()]
    missing = []
    for raw in shown:
        want = normalize_shown(raw)
        if not want.strip() or want.strip() == "...":
            continue
        have = exact
        if loose is not None and re.search(loose, want):
            want, have = skeleton(want), [skeleton(x) for x in exact]
        if "..." in want:
            pattern = re.compile(".*".join(re.escape(p) for p in want.split("...")))
            ok = any(pattern.fullmatch(x) for x in have)
        else:
            ok = want in have
        if not ok:
            missing.append(raw)
    return missing
