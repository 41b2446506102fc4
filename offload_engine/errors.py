"""The project's exception root: every error offload-engine raises on purpose derives from
``OffloadEngineError``.

The command line relies on it: an ``OffloadEngineError`` is something the user can act on
(bad input, a full disk, a second writer) and is printed as one line with exit code 2;
anything else is a bug in offload-engine and is shown with its traceback and a request to
report it (cli/main.py).

Subclasses keep the builtin base that callers caught before the root existed as a second
base (``InputError`` is a ``ValueError``, ``FileIOError`` an ``OSError``, ...), so an
``except ValueError`` written against an earlier version keeps working.

Where each family lives (each layer defines its own, on top of these):
- ``io/errors.py``: ``FileIOError`` (errno, path, offset, length), ``TruncatedFileError``,
  ``WrappedIOError`` (the one wrapper that adds who was reading or writing), pool errors;
- ``layout/``: ``ChecksumError``, ``MetadataError``; ``store/errors.py``: ``BucketIOError``;
- ``formats/errors.py``: ``FormatError`` and the checkpoint family (``CheckpointError``,
  ``CheckpointSaveError``, ``CheckpointExistsError``).
"""

from __future__ import annotations


class OffloadEngineError(Exception):
    """Root of every error offload-engine raises on purpose."""


class InputError(OffloadEngineError, ValueError):
    """A value, option, file or shape the caller gave that cannot be used; the message says
    which and why."""


class UsageError(OffloadEngineError, RuntimeError):
    """An API called in a state that does not allow it (a closed store, a handle released
    twice, a snapshot while buckets are held)."""


class ProcessFailedError(OffloadEngineError, RuntimeError):
    """A child process (a training rank, a benchmark worker) failed; its own output says
    why."""


class OperationTimeoutError(OffloadEngineError, TimeoutError):
    """Something waited on did not finish within its bound (a snapshot, a commit)."""


class PathExistsError(OffloadEngineError, FileExistsError):
    """Something is already where offload-engine would create a file, array, group or
    checkpoint; the message names the path and what is there."""
