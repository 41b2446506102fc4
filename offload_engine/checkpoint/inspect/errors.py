"""Errors of offline inspection. All are ValueErrors: the CLI prints them as one line, exit 2."""

from __future__ import annotations


class InspectError(ValueError):
    """Input that cannot be inspected (unknown kind, malformed manifest, missing rank...).

    The message names the file or directory and says what is wrong.
    """


class ChecksumError(InspectError):
    """A checkpoint chunk file whose crc32c is not the one its manifest records."""
