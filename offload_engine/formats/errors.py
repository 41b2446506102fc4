"""Errors of reading checkpoints and weight files. All are ValueErrors whose message names
the file (or directory) and says what is wrong; the command line prints them as one line
and exits 2.

A chunk file that does not match its recorded crc32c is ``layout.checksums.ChecksumError``,
whoever reads it; an I/O failure is ``io.FileIOError`` (errno, path, offset, length).
"""

from __future__ import annotations


class FormatError(ValueError):
    """Input that cannot be read as what it is: unknown kind, malformed manifest or
    header, a missing rank, an impossible shape."""


class CheckpointError(FormatError):
    """One of our checkpoints that cannot be loaded: missing, torn, corrupt, or (when
    loading into a model) one of another model."""
