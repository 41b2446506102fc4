"""The ``latest`` file that our checkpoints and DeepSpeed's both keep: one line naming the
newest generation (ours) or tag folder (DeepSpeed) beside it. Read here, once, for every
format.

People edit ``latest`` by hand to roll back, so it is read as text a person may have
written (a final newline or none, ``\\r\\n`` too), but nothing else is accepted: a name
holding a control character, surrounding blanks or a path separator is garbage (a corrupt
file, a stray write), never a generation, and the message says so and names the file. The
name is shown with ``repr``, so no byte of a corrupt file reaches the terminal as is.
"""

from __future__ import annotations

import os

from ..layout.generations import LATEST
from .errors import FormatError

MAX_BYTES = 4096  # longer is not a name someone wrote: garbage, not read further


def read_latest(root: str, error: type[FormatError] = FormatError) -> str:
    """The name ``root/latest`` holds, checked to name an entry of ``root`` (not a path).

    Raises ``error`` (a FormatError) naming the file: "missing" when there is none,
    "unreadable", or what makes its content not a generation or tag folder's name."""
    pointer = os.path.join(root, LATEST)
    try:
        with open(pointer, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise error(f"{pointer}: missing; no checkpoint was committed in {root} (or pass "
                    f"a tag)") from None
    except OSError as e:
        raise error(f"{pointer}: unreadable ({e.strerror or e})") from None
    should = (f"it should hold one line, the name of a generation or tag folder in {root} "
              f"(corrupt? write the name back, or pass a tag)")
    if len(raw) > MAX_BYTES:
        raise error(f"{pointer}: longer than {MAX_BYTES} bytes, not a name; {should}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{pointer}: not UTF-8 text (byte {raw[e.start]:#04x} at offset "
                    f"{e.start}); {should}") from None
    name = text[:-1] if text.endswith("\n") else text
    name = name[:-1] if text.endswith("\r\n") else name
    problem = _name_problem(name)
    if problem:
        raise error(f"{pointer}: {name!r} {problem}; {should}")
    return name


def _name_problem(name: str) -> str | None:
    """Why ``name`` cannot be an entry of the folder ``latest`` is in, or None."""
    if not name:
        return "is empty"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        return "has a control character"
    if name != name.strip():
        return "starts or ends with a blank"
    if "/" in name or os.sep in name:
        return "is a path, not a name"
    if name in (".", ".."):
        return "is not a folder of its own"
    return None
