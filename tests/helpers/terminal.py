"""A stderr that says it is a terminal, for the tests of progress bars (drawn only there)."""

from __future__ import annotations

import io
import sys


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def terminal(monkeypatch) -> Terminal:
    """Make stderr a terminal for the rest of the test (pytest puts its own capture back
    between a fixture's setup and the test, so this runs in the test's body)."""
    stream = Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    return stream


def assert_bar(text: str, label: str) -> None:
    """``text`` holds a tqdm bar labelled ``label`` with a rate and an ETA."""
    assert label in text, text
    assert "/s" in text, f"no rate in {text!r}"
    assert "<" in text, f"no ETA in {text!r}"   # tqdm: [elapsed<remaining, rate]
