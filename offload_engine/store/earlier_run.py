"""What an earlier run left in a store directory, and removing it.

A store is rewritten every step and is no checkpoint: after a crash its arrays hold some
mix of the last steps' state. A run that resumes into the same directory therefore
discards them first (``TieredStore.discard_earlier_run``), and takes its state from a
checkpoint; nothing here ever reads their bytes. Only what the store's own manifest lists
(and names the caller gives) is removed, each name checked to stay inside the directory:
a directory that was never a store loses nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..io import syscalls
from ..io.errors import FileIOError
from ..layout import NodeNotFoundError, read_group
from ..layout.member_paths import inside

STRIPES_DIR = "stripes"  # a stripe directory's folder of chunk files (layout/striping.py)


@dataclass
class EarlierRun:
    """The state an earlier run left in a store directory."""

    root: str
    arrays: list[str] = field(default_factory=list)  # array names, relative to ``root``
    step: int | None = None                          # the last step its manifest recorded
    tensors: int = 0                                 # entries of its tensor table

    def describe(self) -> str:
        """One phrase: what is there (for errors and logs)."""
        shown = ", ".join(self.arrays[:3]) + (", ..." if len(self.arrays) > 3 else "")
        step = f"step {self.step}, " if self.step is not None else ""
        return f"{step}{len(self.arrays)} array(s): {shown}"


def find_earlier_run(root: str, names=()) -> EarlierRun | None:
    """What an earlier run left at ``root``: the arrays its manifest lists and those of
    ``names`` (the caller's own array names) that exist on disk, and its tensor table; None
    when there is neither. (Tables without arrays hold no state, but would describe it.)
    MetadataError (naming the file) when the manifest cannot be read."""
    try:
        attrs = read_group(root)  # a MetadataError names the file and what is wrong
    except NodeNotFoundError:
        attrs = {}
    listed = attrs.get("arrays")
    listed = [n for n in listed if isinstance(n, str)] if isinstance(listed, dict) else []
    # an array listed without its folder holds nothing (the manifest names an array
    # before it is made: a construction that failed in between)
    arrays = [n for n in dict.fromkeys([*listed, *names])
              if os.path.exists(os.path.join(root, n, "zarr.json"))]
    tensors = attrs.get("tensors")
    step = attrs.get("step")
    if not arrays and not tensors:
        return None
    return EarlierRun(root, arrays, step if type(step) is int else None,
                      len(tensors) if isinstance(tensors, dict) else 0)


def remove_earlier_arrays(earlier: EarlierRun, stripes: list[str]) -> None:
    """Remove the arrays of ``earlier`` from its directory (``stripes[0]``) and their chunk
    files from the other stripe directories, then the folders left holding nothing but a
    group's zarr.json (the ``rank{r}`` group of a store written before format version 3)."""
    root = earlier.root
    for name in earlier.arrays:
        _remove(inside(root, name, ValueError, "array name"), root)
        for stripe in stripes[1:]:
            base = os.path.join(stripe, STRIPES_DIR)
            if os.path.isdir(base):
                _remove(inside(base, name, ValueError, "array name"), base)


def _remove(path: str, top: str) -> None:
    """Remove ``path`` (a folder, or only the link if it is a symlink), then each parent
    below ``top`` that is left empty or holding only a group's zarr.json."""
    try:
        if os.path.islink(path) or os.path.isfile(path):
            syscalls.unlink(path)
        elif os.path.isdir(path):
            syscalls.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise FileIOError(e.errno, "remove", path) from e
    parent = os.path.dirname(path)
    while parent != top and parent.startswith(top + os.sep):
        try:
            left = os.listdir(parent)
            if left == ["zarr.json"] or not left:
                syscalls.rmtree(parent)
            else:
                break
        except FileNotFoundError:
            pass
        except OSError as e:
            raise FileIOError(e.errno, "remove", parent) from e
        parent = os.path.dirname(parent)
