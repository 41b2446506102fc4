"""Path names that a manifest gives (array names such as ``rank0/param``, metadata files
such as ``rank0/param/zarr.json``): the one check every reader of our format applies
before it opens one, so that no name leads out of the store or checkpoint directory.

A manifest is input like any other file: a hand-edited, corrupt or hostile one must not
make a reader open ``/etc/passwd``, ``../other-run/...`` or a symlink pointing out of the
directory and take whatever it finds there for the checkpoint's data. Two checks:

- ``name_problem``, on the name alone (pure, used where the manifest is parsed): relative,
  ``/``-separated, no empty, ``.`` or ``..`` part, no NUL or other control character;
- ``inside``, when a reader is about to open it: the name joined to the directory and every
  symlink resolved still lies inside the directory (resolved the same way).

Chunk files of a live store may be symlinks to other NVMe paths (striping): chunk names
are not manifest names and are not checked here.
"""

from __future__ import annotations

import os


def name_problem(name) -> str | None:
    """Why ``name`` (from a manifest) cannot be a path inside the directory (a phrase
    such as "is an absolute path"), or None."""
    if type(name) is not str or not name:
        return "is not a non-empty string"
    if name.startswith("/"):
        return "is an absolute path"
    if any(ord(c) < 0x20 or c == "\x7f" for c in name):
        return "holds a control character"
    for part in name.split("/"):
        if part in (".", ".."):
            return f"has a {part!r} part"
        if not part:
            return "has an empty part ('//' or a trailing '/')"
    return None


def inside(root: str, name: str, error: type[Exception] = ValueError,
           what: str = "path name") -> str:
    """``root/name``, checked to stay inside ``root`` once symlinks are resolved; raises
    ``error`` naming the manifest's name and where it leads otherwise. ``root`` is the
    store or generation directory; ``what`` words the message (e.g. "array name")."""
    problem = name_problem(name)
    if problem is not None:
        raise error(f"{os.path.join(root, 'zarr.json')}: {what} {name!r} {problem}; refused "
                    f"(names in a manifest stay inside its directory)")
    path = os.path.join(root, name)
    base = os.path.realpath(root)
    real = os.path.realpath(path)
    if real != base and not real.startswith(base + os.sep):
        raise error(f"{path}: {what} {name!r} leads out of {root} (to {real}, through a "
                    f"symlink); refused")
    return path
