"""Names from an input checkpoint, made safe for a terminal.

Tensor names, file names and paths come from files someone else may have written: a name
holding ``ESC[2J`` clears the screen of whoever runs ``offload-engine inspect`` on it, one
holding a newline forges a row of the listing, ``U+202E`` reverses what follows. Human
output passes every such text through ``printable``; ``--json`` output stays exact (JSON
escapes control characters itself), so a script gets the names as stored.
"""

from __future__ import annotations


def printable(text: object) -> str:
    """``str(text)`` with every character that is not printable (C0 and C1 controls, DEL,
    line and paragraph separators, bidirectional and other format characters: Python's
    ``str.isprintable``) written as its Python escape (``\\x1b``, ``\\n``, ``\\u202e``);
    text without one comes back unchanged."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)
