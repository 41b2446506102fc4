"""Reading a model description file for ``plan --model``: the checks before its numbers are used.

A ``config.json``, shape list or safetensors index is untrusted (docs/untrusted-input.md):
it is read only from a regular file (a FIFO would block ``plan`` forever, ``/dev/zero``
never ends), at most ``MAX_JSON_BYTES`` with a bounded read, as strict JSON
(``jsonlimits``: no NaN or Infinity, no 4,000-digit integer, no deep nesting, no duplicate
key), and at most ``MAX_JSON_VALUES`` values. A number the architecture is built from must
be an integer (``is_size``): ``hidden_size: 4096.5`` is refused, not truncated to 4096.
"""

from __future__ import annotations

import json
import os
import stat

from ..errors import InputError
from ..jsonlimits import file_kind, read_json_file
from . import model_limits as limits


class ModelInputError(InputError):
    """A model description the planner cannot read: one line naming the file."""


def read_model_json(path: str):
    """The strict JSON document at ``path`` (see the module's docstring); ``ModelInputError``
    naming the file otherwise."""
    doc = read_json_file(path, limits.MAX_JSON_BYTES, what="model description",
                         error=ModelInputError, max_values=limits.MAX_JSON_VALUES)
    if isinstance(doc, dict) and "model_type" in doc and not isinstance(doc["model_type"], str):
        # the family is looked up by it: a list or an object there is not a config
        raise ModelInputError(f"{path}: model_type must be a string naming the model family, "
                              f"got {json.dumps(doc['model_type'])[:60]}")
    return doc


def check_regular(path: str) -> None:
    """Refuse ``path`` unless it is a regular file (after symlinks): a FIFO or a device named
    as a safetensors file would block or never end when its header is read."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise ModelInputError(f"{path}: cannot read: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        raise ModelInputError(f"{path}: is {file_kind(mode)}; a model description is read "
                              f"only from a regular file")


def is_size(value) -> bool:
    """Whether a config number is usable as a size or count: an integer in [0, MAX_DIM]
    (an integral float such as 4096.0 counts; 4096.5, a bool, a string or null do not)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return type(value) is int and 0 <= value <= limits.MAX_DIM
