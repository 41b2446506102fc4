"""The names in a checkpoint directory and the ``latest`` file's one line (docs/format.md,
"Checkpoints"): the rules every reader and writer of the directory follows.

```
<ckpt_dir>/
  latest                       text: the name of the newest committed generation
  step-00000030/               a committed generation (a zarr v3 group; tensor table in zarr.json)
    rank0/                     rank 0's arrays; its shard table in rank0/zarr.json
  step-00000040.partial/       a generation being written, or torn by a crash: never loaded
  step-00000040.superseded-1/  a committed generation latest did not name, set aside when
                               its step was saved again: kept, never loaded
  step-00000010.deleting/      a generation keep_last is removing: never loaded
  best/                        a generation saved with tag="best" (any checked name)
  .writer-lock                 the writing run's lock (flock), with its pid, host and time
```

A generation is written under ``<name>.partial`` and renamed to ``<name>`` when complete
(the commit point); ``latest`` is replaced after. Writing the directory is
``checkpoint/checkpoint_dir.py`` (and ``checkpoint/retention.py`` for ``keep_last``);
reading it (which generation loads) is ``formats/ours/checkpoint_listing.py``.

DeepSpeed keeps a ``latest`` file of the same syntax beside its tag folders, so
``read_latest`` serves both formats' readers.
"""

from __future__ import annotations

import os
import re

from ..errors import InputError
from ..io import syscalls
from .metadata import ZARR_JSON

PARTIAL = ".partial"
LATEST = "latest"
# <name>.superseded-<k>: a generation that latest did not name when its step was saved
# again (an orphan of a crash between commit and latest, or of a rollback); never loaded
SUPERSEDED = ".superseded-"
# <name>.deleting: a generation retention (keep_last) is removing; never loaded, and swept
# by the next save's retention when a crash left it half removed
DELETING = ".deleting"
# flocked by the run saving into the folder (checkpoint/writer_lock.py); never a generation
WRITER_LOCK = ".writer-lock"

MAX_TAG = 128          # characters
MAX_LATEST_BYTES = 4096  # a longer `latest` is not a name someone wrote: garbage, not read further

_GENERATION = re.compile(r"step-\d{8,}")
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=@-]*")


def generation_name(step: int) -> str:
    """The directory name of the generation saved at ``step``."""
    return f"step-{step:08d}"


def is_generation_name(name: str) -> bool:
    """Whether ``name`` is a committed generation's directory name (``step-<8+ digits>``)."""
    return _GENERATION.fullmatch(name) is not None


def staging_path(final: str) -> str:
    """Where the generation that commits as ``final`` is written: ``<final>.partial``."""
    return final + PARTIAL


def superseded_path(final: str, k: int) -> str:
    """The ``k``-th name (from 1) a set-aside generation ``final`` may take."""
    return f"{final}{SUPERSEDED}{k}"


def deleting_path(final: str) -> str:
    """The name generation ``final`` takes while ``keep_last`` removes it."""
    return final + DELETING


def is_torn(name: str) -> bool:
    """Whether ``name`` is a generation being written or torn by a crash (``.partial``)."""
    return name.endswith(PARTIAL)


def is_being_deleted(name: str) -> bool:
    """Whether ``name`` is a generation ``keep_last`` is removing (``.deleting``)."""
    return name.endswith(DELETING)


def is_set_aside(name: str) -> bool:
    """Whether ``name`` is a generation set aside when its step was saved again."""
    return SUPERSEDED in name


def check_tag(tag) -> str:
    """``tag`` if it can name a generation; InputError (a ValueError) saying why not.
    Letters, digits and ``. _ + = @ -``, starting with a letter or digit, at most 128
    characters; no ``..``, no ``/``; not ``latest``, not ending in ``.partial``, no
    ``.superseded-`` or ``.deleting`` in it: a tag can never be mistaken for a name the
    checkpoint itself uses."""
    if not isinstance(tag, str):
        raise InputError(f"tag must be a string, got {type(tag).__name__}")
    why = None
    if not tag:
        why = "it is empty"
    elif len(tag) > MAX_TAG:
        why = f"it is longer than {MAX_TAG} characters"
    elif "/" in tag or "\\" in tag:
        why = "it holds a slash (a tag is one directory name, not a path)"
    elif ".." in tag:
        why = "it holds '..'"
    elif not _TAG.fullmatch(tag):
        why = ("only letters, digits and . _ + = @ - are allowed, starting with a letter "
               "or digit")
    elif tag == LATEST or tag == ZARR_JSON:
        why = f"{tag!r} is a file name of the checkpoint folder"
    elif is_torn(tag):
        why = f"a name ending in {PARTIAL!r} is a generation being written"
    elif is_set_aside(tag) or DELETING in tag:
        why = f"names holding {SUPERSEDED!r} or {DELETING!r} are set aside by the checkpoint"
    if why:
        raise InputError(f"checkpoint tag {tag!r} is not allowed: {why}")
    return tag


def generation_dir_name(step: int, tag: str | None) -> str:
    """The directory name of a generation: ``tag`` (checked) or ``step-<step>``."""
    return generation_name(step) if tag is None else check_tag(tag)


def read_latest(root: str, error: type[Exception]) -> str:
    """The name ``root/latest`` holds, checked to name an entry of ``root`` (not a path).

    People edit ``latest`` by hand to roll back, so it is read as text a person may have
    written (a final newline or none, ``\\r\\n`` too), but nothing else is accepted: a name
    holding a control character, surrounding blanks or a path separator is garbage (a
    corrupt file, a stray write), never a generation. Raises ``error`` (the caller's
    family: CheckpointError, DeepSpeedLayoutError, FormatError) naming the file: "missing"
    when there is none, "unreadable", or what makes its content not a generation or tag
    folder's name; the name is shown with ``repr``, so no byte of a corrupt file reaches
    the terminal as is."""
    pointer = os.path.join(root, LATEST)
    try:
        raw = syscalls.read_all(pointer, limit=MAX_LATEST_BYTES)
    except FileNotFoundError:
        raise error(f"{pointer}: missing; no checkpoint was committed in {root} (or pass "
                    f"a tag)") from None
    except OSError as e:
        raise error(f"{pointer}: unreadable ({e.strerror or e})") from None
    should = (f"it should hold one line, the name of a generation or tag folder in {root} "
              f"(corrupt? write the name back, or pass a tag)")
    if len(raw) > MAX_LATEST_BYTES:
        raise error(f"{pointer}: longer than {MAX_LATEST_BYTES} bytes, not a name; {should}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{pointer}: not UTF-8 text (byte {raw[e.start]:#04x} at offset "
                    f"{e.start}); {should}") from None
    name = text[:-1] if text.endswith("\n") else text
    name = name[:-1] if text.endswith("\r\n") else name
    problem = _latest_name_problem(name)
    if problem:
        raise error(f"{pointer}: {name!r} {problem}; {should}")
    return name


def _latest_name_problem(name: str) -> str | None:
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
