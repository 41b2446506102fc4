"""Rewrite every ```usage: offload-engine ...``` block in docs/*.md and README.md with what
`COLUMNS=80 offload-engine WORDS --help` prints now (what tests/project/
test_docs_consistency.py compares them with). Run after changing a command's options, help
or examples:

    .venv/bin/python tools/regen_cli_help.py          # rewrite, list the files changed
    .venv/bin/python tools/regen_cli_help.py --check  # exit 1 if any block is stale
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = re.compile(r"^```\n(usage: offload-engine[^\n]*\n.*?)^```$", re.M | re.S)
WORD = re.compile(r"[a-z][a-z0-9-]*")


def real_help(words: list[str]) -> str:
    """The command's help at 80 columns, as the docs show it."""
    done = subprocess.run([sys.executable, "-m", "offload_engine.cli.main", *words, "--help"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300, check=True,
                          env={**os.environ, "COLUMNS": "80", "NO_COLOR": "1"})
    return done.stdout


def command_words(block: str) -> list[str]:
    """The command words of a usage block's first line ("usage: offload-engine bench io")."""
    words = []
    for token in block.split("\n", 1)[0].split()[2:]:
        if not WORD.fullmatch(token):
            break
        words.append(token)
    return words


def main(argv: list[str]) -> int:
    stale = []
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [
            os.path.join(ROOT, "README.md")]:
        with open(path) as f:
            text = f.read()
        new = BLOCK.sub(lambda m: "```\n" + real_help(command_words(m.group(1))) + "```", text)
        if new != text:
            stale.append(os.path.relpath(path, ROOT))
            if "--check" not in argv:
                with open(path, "w") as f:
                    f.write(new)
    for name in stale:
        print(name)
    return 1 if stale and "--check" in argv else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
