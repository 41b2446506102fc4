"""argparse value types shared by the subcommands: sizes and counts with one-line errors."""

from __future__ import annotations

import argparse

from ..units import parse_bytes


def byte_size(text: str) -> int:
    """Bytes from "64MiB", "5GB" or "4096"."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def aligned_size(text: str) -> int:
    """A positive multiple of 4096 bytes (an O_DIRECT-legal request)."""
    n = byte_size(text)
    if n <= 0 or n % 4096:
        raise argparse.ArgumentTypeError(f"{text}: must be a positive multiple of 4096 bytes")
    return n


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be >= 1")
    return n
