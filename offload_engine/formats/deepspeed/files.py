"""Find a DeepSpeed checkpoint's tag folder and its per-rank files, with errors that name them.

Layout (``deepspeed/runtime/engine.py``)::

    <root>/latest                                           text: the tag, e.g. global_step14
    <root>/<tag>/mp_rank_00_model_states.pt                 ZeRO-1/2: one file
    <root>/<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt  ZeRO-3: one per data-parallel rank
    <root>/<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt  one per rank

The ``bf16_`` prefix marks any bf16 run (ZeRO-3 included).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..errors import FormatError
from ...layout.checkpoint_names import LATEST, read_latest

_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def is_optim_file(name: str) -> bool:
    """Whether a file name is one of a ZeRO tag folder's per-rank optimizer files."""
    return _OPTIM.match(name) is not None


class DeepSpeedLayoutError(FormatError):
    """The checkpoint folder is not a complete ZeRO checkpoint; the message names the path."""


def resolve_tag_dir(root: str, tag: str | None) -> tuple[str, str]:
    """(tag, tag folder) from ``--tag`` or the ``latest`` file."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise DeepSpeedLayoutError(f"{root}: checkpoint folder not found")
    if tag is None:
        latest = os.path.join(root, LATEST)
        if not os.path.exists(latest):
            tags = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
            hint = f" (tag folders here: {', '.join(tags)})" if tags else ""
            raise DeepSpeedLayoutError(f"{latest}: no 'latest' file; pass --tag{hint}")
        tag = read_latest(root, DeepSpeedLayoutError)
    tag_dir = os.path.join(root, tag)
    if not os.path.isdir(tag_dir):
        raise DeepSpeedLayoutError(f"{tag_dir}: tag folder {tag!r} not found")
    return tag, tag_dir


@dataclass(frozen=True)
class OptimFiles:
    """The optimizer-state files of one tag folder, by data-parallel rank."""

    tag_dir: str
    by_rank: dict[int, str]
    bf16: bool

    def path(self, rank: int) -> str:
        """The file of ``rank``, or the name it should have (for errors)."""
        name = f"{'bf16_' if self.bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        return self.by_rank.get(rank, os.path.join(self.tag_dir, name))


def find_optim_files(tag_dir: str) -> OptimFiles:
    """Scan ``tag_dir`` for ``[bf16_]zero_pp_rank_<r>_mp_rank_<m>_optim_states.pt``."""
    by_rank: dict[int, str] = {}
    prefixes = set()
    for name in sorted(os.listdir(tag_dir)):
        if "expp_rank" in name:
            raise DeepSpeedLayoutError(f"{os.path.join(tag_dir, name)}: mixture-of-experts "
                                       f"checkpoints without ZeRO (expp_rank optimizer files) are "
                                       f"not supported, only ZeRO-1/2 ones")
        m = _OPTIM.match(name)
        if not m:
            continue
        if int(m.group(3)) != 0:
            raise DeepSpeedLayoutError(f"{os.path.join(tag_dir, name)}: model-parallel (tensor or "
                                       f"pipeline) checkpoints are not supported, only mp_rank_00")
        prefixes.add(m.group(1) or "")
        by_rank[int(m.group(2))] = os.path.join(tag_dir, name)
    if not by_rank:
        raise DeepSpeedLayoutError(f"{tag_dir}: no ZeRO optimizer files (*_optim_states.pt); "
                                   f"not a ZeRO-1/2/3 checkpoint folder")
    if len(prefixes) > 1:
        raise DeepSpeedLayoutError(f"{tag_dir}: holds both bf16_ and plain optimizer files "
                                   f"(two runs saved into one tag?)")
    return OptimFiles(tag_dir, by_rank, bf16=prefixes == {"bf16_"})


def check_rank_count(files: OptimFiles, world_size: int, told_by: str) -> list[str]:
    """The optim files of ranks 0..world_size-1 in order; errors name a missing or extra file."""
    for r in range(world_size):
        if r not in files.by_rank:
            raise DeepSpeedLayoutError(f"{files.path(r)}: missing rank file (partition_count "
                                       f"{world_size} in {told_by})")
    extra = sorted(r for r in files.by_rank if r >= world_size)
    if extra:
        raise DeepSpeedLayoutError(
            f"{files.by_rank[extra[0]]}: unexpected rank file: {told_by} says partition_count "
            f"{world_size}, but {len(files.by_rank)} optimizer files are present")
    return [files.by_rank[r] for r in range(world_size)]


def model_files(tag_dir: str, stage: int, world_size: int) -> list[str]:
    """Model-state files: one for ZeRO-1/2, one per rank (in rank order) for ZeRO-3."""
    names = (["mp_rank_00_model_states.pt"] if stage <= 2 else
             [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world_size)])
    paths = []
    for name in names:
        path = os.path.join(tag_dir, name)
        if not os.path.isfile(path) and os.path.isfile(os.path.join(tag_dir, "bf16_" + name)):
            path = os.path.join(tag_dir, "bf16_" + name)
        if not os.path.isfile(path):
            raise DeepSpeedLayoutError(f"{path}: missing model states file (ZeRO stage {stage}, "
                                       f"world size {world_size})")
        paths.append(path)
    return paths
