"""DeepSpeed AutoEP checkpoints under ZeRO-3 (``expert_parallel`` in the config, 0.19.2+).

AutoEP replaces a model's MoE blocks by layers with grouped experts ``<layer>.experts.w1``,
``w2``, ``w3`` of shape [experts on this rank, out, in]. Under ZeRO-3 every rank writes its
model states (``param_shapes`` with those local shapes; ``ds_autoep_layers``: per MoE
layer, its ``expert_key_prefix``, ``num_experts``, ``num_local_experts``, this rank's
``ep_rank`` and ``global_expert_start``, the ``expert_placement``) and its optimizer file,
whose ``ds_zero_partition_groups`` say, per sub-group, which ranks partition it
(``partition_ranks``) and this rank's place among them (``partition_rank``): the dense
sub-groups over all ranks, the expert sub-groups over the expert data-parallel group. So
each expert data-parallel group holds one copy of the expert tensors: its experts, global
ids ``global_expert_start ..``; consolidated, the copies are stacked on the expert
dimension into [num_experts, out, in] under the same name (DeepSpeed's own grouped
names, ``logical_shape`` of its affine maps).
"""

from __future__ import annotations

import math

from ..safe_unpickler import PtFile, short_repr
from .files import DeepSpeedLayoutError
from .partitions import PartitionError, Piece

AUTOEP_LAYERS = "ds_autoep_layers"
ZERO3_FORMAT = ("zero3_partitioned", 1)   # checkpoint_format, checkpoint_format_version


def zero3_partitions(optims: list[PtFile], osds: list[dict], group_counts: list[int]
                     ) -> list[list[tuple[tuple[int, ...], int]]]:
    """``[rank][sub-group]`` (the ranks partitioning it, this rank's index among them),
    from ``ds_zero_partition_groups``; every sub-group over all ranks where absent."""
    world = len(optims)
    every = tuple(range(world))
    out = []
    for r, (pt, osd) in enumerate(zip(optims, osds)):
        groups = osd.get("ds_zero_partition_groups")
        if groups is None:
            out.append([(every, r)] * group_counts[r])
            continue
        if not isinstance(groups, (list, tuple)) or len(groups) != group_counts[r]:
            raise DeepSpeedLayoutError(f"{pt.path}: 'ds_zero_partition_groups' is {short_repr(groups)}, "
                                       f"expected one entry per fp32 sub-group ({group_counts[r]})")
        mine = []
        for g, entry in enumerate(groups):
            ranks = entry.get("partition_ranks") if isinstance(entry, dict) else None
            index = entry.get("partition_rank") if isinstance(entry, dict) else None
            if not (isinstance(ranks, (list, tuple)) and ranks and type(index) is int
                    and all(type(x) is int and 0 <= x < world for x in ranks)
                    and len(set(ranks)) == len(ranks) and 0 <= index < len(ranks)
                    and ranks[index] == r):
                raise DeepSpeedLayoutError(f"{pt.path}: sub-group {g}'s partition "
                                           f"{short_repr(entry)} does not place rank {r} among "
                                           f"ranks 0..{world - 1}")
            mine.append((tuple(ranks), index))
        out.append(mine)
    return out


def autoep_experts(model: PtFile) -> dict[str, int]:
    """{expert tensor prefix (``<layer>.experts``): expert count} of an AutoEP run."""
    layers = model.obj.get(AUTOEP_LAYERS) or []
    return {e["expert_key_prefix"]: e["num_experts"] for e in layers if isinstance(e, dict)
            and isinstance(e.get("expert_key_prefix"), str) and type(e.get("num_experts")) is int} \
        if isinstance(layers, (list, tuple)) else {}


def _layer_of(model: PtFile, name: str) -> dict | None:
    """The ``ds_autoep_layers`` entry whose experts include parameter ``name``."""
    layers = model.obj.get(AUTOEP_LAYERS) or []
    if not isinstance(layers, (list, tuple)):
        raise DeepSpeedLayoutError(f"{model.path}: '{AUTOEP_LAYERS}' is {short_repr(layers)}, "
                                   f"expected a list of MoE layers")
    prefix = name.rsplit(".", 1)[0]
    for entry in layers:
        if isinstance(entry, dict) and entry.get("expert_key_prefix") == prefix:
            return entry
    return None


def _int(entry: dict, key: str, model: PtFile) -> int:
    value = entry.get(key)
    if type(value) is not int or value < 0:
        raise DeepSpeedLayoutError(f"{model.path}: AutoEP layer {entry.get('expert_key_prefix')!r}: "
                                   f"'{key}' is {short_repr(value)}, expected a count")
    return value


def assemble_experts(name: str, shape: tuple[int, ...], copies: dict[tuple[int, ...], list[Piece]],
                     models: list[PtFile]) -> tuple[tuple[int, ...], list[Piece]]:
    """The global shape and pieces of tensor ``name`` of local ``shape``, held as
    ``copies`` (one per group of ranks): a dense tensor has one copy over every rank; an
    AutoEP expert tensor one per expert data-parallel group, stacked by expert id."""
    if len(copies) == 1 and len(next(iter(copies))) == len(models):
        return shape, next(iter(copies.values()))
    numel = math.prod(shape)
    placed: dict[int, list[Piece]] = {}
    total, told_by = None, None
    for ranks, pieces in copies.items():
        model = models[ranks[0]]
        entry = _layer_of(model, name)
        if entry is None:
            raise DeepSpeedLayoutError(f"{model.path}: {name} is partitioned over ranks {list(ranks)} "
                                       f"only, but no AutoEP layer ('{AUTOEP_LAYERS}') holds it")
        fmt = (entry.get("checkpoint_format"), entry.get("checkpoint_format_version"))
        if fmt != ZERO3_FORMAT:
            raise DeepSpeedLayoutError(f"{model.path}: AutoEP expert state format {short_repr(fmt)}; "
                                       f"only {ZERO3_FORMAT} is read")
        local, experts = _int(entry, "num_local_experts", model), _int(entry, "num_experts", model)
        start = _int(entry, "global_expert_start", model)
        for r in ranks[1:]:
            other = _layer_of(models[r], name) or {}
            if other.get("global_expert_start") != start:
                raise DeepSpeedLayoutError(f"{models[r].path}: {name}: experts from "
                                           f"{short_repr(other.get('global_expert_start'))}, but "
                                           f"{model.path} (same partition group) says {start}")
        if not shape or shape[0] != local or start % max(local, 1) or start + local > experts:
            raise DeepSpeedLayoutError(f"{model.path}: {name} {list(shape)}: not {local} local experts "
                                       f"from expert {start} of {experts}")
        if start in placed:
            raise DeepSpeedLayoutError(f"{model.path}: {name}: experts from {start} held by two "
                                       f"partition groups")
        total, told_by = (experts, model.path) if total is None else (total, told_by)
        if total != experts:
            raise DeepSpeedLayoutError(f"{model.path}: {name}: {experts} experts, but {told_by} says "
                                       f"{total} (expert counts differ between files)")
        per_expert = numel // max(local, 1)
        placed[start] = [Piece(start * per_expert + p.start, p.count, p.src, p.src_offset)
                         for p in pieces]
    local = shape[0]
    expect = 0  # the first expert of the next copy (walking the copies: the count is untrusted)
    for start in sorted(placed):
        if start != expect:
            break
        expect = start + local
    if expect != total:
        raise PartitionError(f"{name}: no rank file holds experts {expect}..{expect + local - 1} "
                             f"of {total}")
    return (total, *shape[1:]), [p for s in sorted(placed) for p in placed[s]]
