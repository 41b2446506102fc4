"""Which tensors and states a command works on: ``--name`` globs and ``--state`` names."""

from __future__ import annotations

import fnmatch
from typing import Iterable, Sequence

from ..formats.source import TensorMeta


def name_matches(name: str, globs: Sequence[str] | None) -> bool:
    """Whether ``name`` matches any fnmatch glob of ``globs`` (every name does when empty)."""
    return not globs or any(fnmatch.fnmatchcase(name, g) for g in globs)


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
