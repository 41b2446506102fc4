"""Errors of offline inspection. All are ValueErrors: the CLI prints them as one line, exit 2.

A chunk file that does not match its recorded crc32c is the checkpoint layer's
``ChecksumError`` (``offload_engine.checkpoint.checksums``), whoever reads it.
"""

from __future__ import annotations


class InspectError(ValueError):
    """Input that cannot be inspected (unknown kind, malformed manifest, missing rank...).

    The message names the file or directory and says what is wrong.
    """
