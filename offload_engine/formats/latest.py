"""The ``latest`` file that our checkpoints and DeepSpeed's both keep: one line naming the
newest generation (ours) or tag folder (DeepSpeed) beside it. Read here, once, for every
format."""

from __future__ import annotations

import os

from ..layout.generations import LATEST
from .errors import FormatError


def read_latest(root: str, error: type[FormatError] = FormatError) -> str:
    """The name ``root/latest`` holds, checked to name an entry of ``root`` (not a path).

    Raises ``error`` (a FormatError) naming the file: FileNotFoundError-like "missing" when
    there is none, "unreadable", or "does not name a generation or tag folder"."""
    pointer = os.path.join(root, LATEST)
    try:
        with open(pointer, encoding="utf-8") as f:
            name = f.read().strip()
    except FileNotFoundError:
        raise error(f"{pointer}: missing; no checkpoint was committed in {root} (or pass "
                    f"a tag)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{pointer}: unreadable ({e})") from None
    if not name or "/" in name or os.sep in name or name in (".", ".."):
        raise error(f"{pointer}: does not name a generation or tag folder ({name!r})")
    return name
