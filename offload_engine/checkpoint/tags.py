"""User-chosen generation names (``tag="best"``, ``tag=f"epoch-{e}"``): which names are
safe as a directory inside the checkpoint folder and cannot be mistaken for the names the
checkpoint itself uses (``latest``, ``<gen>.partial``, ``<gen>.superseded-<k>``,
``<gen>.deleting``)."""

from __future__ import annotations

import re

from ..layout.generations import DELETING, LATEST, PARTIAL, SUPERSEDED, generation_name
from ..errors import InputError

MAX_TAG = 128  # characters
_ALLOWED = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=@-]*")


def check_tag(tag) -> str:
    """``tag`` if it can name a generation; ValueError saying why not. Letters, digits and
    ``. _ + = @ -``, starting with a letter or digit, at most 128 characters; no ``..``,
    no ``/``; not ``latest``, not ending in ``.partial``, no ``.superseded-`` or
    ``.deleting`` in it."""
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
    elif not _ALLOWED.fullmatch(tag):
        why = ("only letters, digits and . _ + = @ - are allowed, starting with a letter "
               "or digit")
    elif tag == LATEST or tag == "zarr.json":
        why = f"{tag!r} is a file name of the checkpoint folder"
    elif tag.endswith(PARTIAL):
        why = f"a name ending in {PARTIAL!r} is a generation being written"
    elif SUPERSEDED in tag or DELETING in tag:
        why = f"names holding {SUPERSEDED!r} or {DELETING!r} are set aside by the checkpoint"
    if why:
        raise InputError(f"checkpoint tag {tag!r} is not allowed: {why}")
    return tag


def generation_dir(step: int, tag: str | None) -> str:
    """The directory name of a generation: ``tag`` (checked) or ``step-<step>``."""
    return generation_name(step) if tag is None else check_tag(tag)
