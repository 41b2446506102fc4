"""Which tensors and states a command works on: ``--name`` globs and ``--state`` names."""

from __future__ import annotations

import fnmatch
import re
from typing import Iterable, Sequence

from ..formats.source import TensorMeta


# one expert of a grouped stack, as ``--expert E`` lists it: ``layers.0.moe.experts.w1[3]``
_EXPERT_SUFFIX = re.compile(r"\[\d+\]$")


def name_matches(name: str, globs: Sequence[str] | None) -> bool:
    """Whether ``name`` matches any fnmatch glob of ``globs`` (every name does when empty).
    One expert of a stack (``stack[e]``) matches by the stack's name too: ``--name
    '*.w1' --expert 3`` selects ``layers.0.moe.experts.w1[3]``."""
    if not globs:
        return True
    plain = _EXPERT_SUFFIX.sub("", name)
    return any(fnmatch.fnmatchcase(name, g) or fnmatch.fnmatchcase(plain, g) for g in globs)


def select(tensors: Iterable[TensorMeta], names: Sequence[str] | None = None,
           states: Sequence[str] | None = None) -> list[tuple[TensorMeta, list[str]]]:
    """Tensors whose name matches any glob of ``names`` (all when empty), each with its
    states among ``states`` (all when empty); tensors left with no state are dropped."""
    out = []
    for t in tensors:
        if not name_matches(t.name, names):
            continue
        keep = [s for s in t.states if not states or s in states]
        if keep:
            out.append((t, keep))
    return out
