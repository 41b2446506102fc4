"""DeepSpeed mixture-of-experts checkpoints (``deepspeed.moe.layer.MoE`` under ZeRO-1/2).

Layout (``deepspeed/runtime/engine.py``, ``_save_moe_checkpoint``; DeepSpeed 0.19)::

    <tag>/mp_rank_00_model_states.pt        the model without expert weights (the gates
                                            ``...deepspeed_moe.gate.wg.weight`` stay), and
                                            ``num_experts``: one count per MoE layer
    <tag>/layer_<L>_expert_<E>_mp_rank_00_model_states.pt
                                            expert E (global id) of MoE layer L (MoE layers
                                            numbered in module order), its weights under
                                            ``<layer>.deepspeed_moe.experts.deepspeed_experts.<E>.``
    <tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt   one per rank, as without experts

A rank holds ``num_experts / ep`` experts of each layer (ep: the expert-parallel size),
under *local* ids 0..n-1; DeepSpeed puts them in their own param group (``moe: True``,
``name: ep_size_<ep>``), partitioned over the expert data-parallel group: that group's
``partition_count`` is ``world / ep``. The model states' ``param_shapes`` are rank 0's, so
an expert group lists the local names of expert-parallel rank 0. Expert-parallel rank k's
local expert i is global expert ``k * n + i``.

Which ranks form which group (``deepspeed/utils/groups.py``): by default expert-parallel
rank ``r % ep`` and expert data-parallel rank ``r // ep``; with the config's
``use_data_before_expert_parallelism``, ``r // (world / ep)`` and ``r % (world / ep)``.

Tensors keep DeepSpeed's per-expert names with global ids (``moe0.deepspeed_moe.experts.
deepspeed_experts.3.w1.weight``): what the expert files hold, and what the model's own
``load_state_dict`` of a run with ep = 1 takes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..safe_unpickler import PtFile, TensorRef, load_pt, short_repr
from .files import DeepSpeedLayoutError

EXPERT_INFIX = ".deepspeed_moe.experts.deepspeed_experts."
_EXPERT_NAME = re.compile(r"^(.*)" + re.escape(EXPERT_INFIX) + r"(\d+)\.(.+)$")
_EXPERT_FILE = re.compile(r"^(bf16_)?layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
USE_DATA_BEFORE_EXPERT = "use_data_before_expert_parallelism"


def split_expert_name(name: str) -> tuple[str, int, str] | None:
    """(MoE layer prefix, expert id, rest) of an expert parameter's name, None for others."""
    m = _EXPERT_NAME.match(name)
    return (m.group(1), int(m.group(2)), m.group(3)) if m else None


def expert_name(prefix: str, expert: int, rest: str) -> str:
    return f"{prefix}{EXPERT_INFIX}{expert}.{rest}"


def find_expert_files(tag_dir: str) -> dict[tuple[int, int], str]:
    """{(MoE layer, global expert): path} of the tag folder's per-expert model-state files."""
    out = {}
    for name in sorted(os.listdir(tag_dir)):
        m = _EXPERT_FILE.match(name)
        if not m:
            continue
        path = os.path.join(tag_dir, name)
        if int(m.group(4)) != 0:
            raise DeepSpeedLayoutError(f"{path}: model-parallel (tensor or pipeline) checkpoints "
                                       f"are not supported, only mp_rank_00")
        out[(int(m.group(2)), int(m.group(3)))] = path
    return out


def expert_file_name(tag_dir: str, layer: int, expert: int) -> str:
    return os.path.join(tag_dir, f"layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt")


@dataclass
class ExpertLayout:
    """How each ZeRO-1/2 param group is partitioned, and under which names.

    ``replicas[g]``: per copy of group g's flat layout (one for a dense group, ep for an
    expert group), ``(ranks in partition order, parameter names in flat order)``.
    ``expert_files``: the per-expert files read (checked against the optimizer's shapes).
    """

    replicas: list[list[tuple[list[int], list[str]]]]
    shapes: dict[str, tuple[int, ...]]   # every trainable parameter's, by its global name
    expert_files: list[PtFile]
    experts: dict[str, int]              # MoE layer prefix -> its expert count

    def ordered(self, names: list[str]) -> list[str]:
        """``names`` with experts by layer, then global expert id, each expert's parameters
        in their flat order (the optimizer lists them by expert-parallel rank)."""
        layer_at, rest_at = {}, {}
        for n in names:
            parts = split_expert_name(n)
            if parts:
                layer_at.setdefault(parts[0], len(layer_at))
                rest_at.setdefault(parts[2], len(rest_at))

        def key(item):
            i, n = item
            parts = split_expert_name(n)
            return (0, i, 0, 0) if parts is None else (1, layer_at[parts[0]], parts[1], rest_at[parts[2]])
        return [n for _, n in sorted(enumerate(names), key=key)]


def _num_experts(model: PtFile) -> list[int]:
    counts = model.obj.get("num_experts")
    if isinstance(counts, int) and not isinstance(counts, bool):
        counts = [counts]
    if counts is None:
        return []
    if not isinstance(counts, (list, tuple)) or not all(
            type(c) is int and c > 0 for c in counts):
        raise DeepSpeedLayoutError(f"{model.path}: 'num_experts' is {short_repr(counts)}, expected "
                                   f"a list of positive expert counts, one per MoE layer")
    return list(counts)


def ep_ranks(world: int, ep: int, data_first: bool) -> list[list[int]]:
    """Per expert-parallel rank, the global ranks of its expert data-parallel group in
    partition order (DeepSpeed's ``_create_expert_and_data_parallel``)."""
    dp = world // ep
    if data_first:
        return [[k * dp + j for j in range(dp)] for k in range(ep)]
    return [[k + j * ep for j in range(dp)] for k in range(ep)]


def expert_layout(tag_dir: str, model: PtFile, group_names: list[list[str]],
                  group_shapes: dict[str, tuple[int, ...]], partition_counts: list[int],
                  world: int, told_by: str) -> ExpertLayout:
    """The partitioning of every param group (see the module docstring) and the checked
    expert files.

    Args:
        model: the model states file (``num_experts``, ``ds_config``).
        group_names: per param group, its names in ``param_shapes`` (local expert ids).
        group_shapes: every name's shape.
        partition_counts: per param group, ``partition_count`` from the optimizer file.
        world: the data-parallel world size (the optimizer files present).
        told_by: the optimizer file the counts come from, for errors.

    Raises DeepSpeedLayoutError naming the file or parameter: an expert file missing, one
    more than the counts say, expert counts that differ between the model states, the
    optimizer partitions and the expert files, or an expert file whose names or shapes
    are not those of the optimizer's parameters.
    """
    files = find_expert_files(tag_dir)
    counts = _num_experts(model)
    if not files and not any(split_expert_name(n) for g in group_names for n in g):
        if len(partition_counts) != len(group_names):
            raise DeepSpeedLayoutError(f"{told_by}: {len(partition_counts)} partition counts for "
                                       f"{len(group_names)} param groups")
        for g, pc in enumerate(partition_counts):
            if pc != world:
                raise DeepSpeedLayoutError(f"{told_by}: param group {g} is partitioned over {pc} "
                                           f"ranks, not the {world} of the checkpoint, and holds "
                                           f"no expert parameters")
        return ExpertLayout([[(list(range(world)), list(g))] for g in group_names], dict(group_shapes), [], {})
    config = model.obj.get("ds_config")
    data_first = bool(config.get(USE_DATA_BEFORE_EXPERT)) if isinstance(config, dict) else False
    prefixes = _layer_prefixes(files, tag_dir)
    if len(prefixes) != len(counts):
        raise DeepSpeedLayoutError(f"{model.path}: 'num_experts' lists {len(counts)} MoE layers "
                                   f"but the expert files (layer_<L>_expert_<E>_...) hold "
                                   f"{len(prefixes)}")
    count_of = dict(zip(prefixes, counts))
    replicas = []
    for g, names in enumerate(group_names):
        pc = partition_counts[g] if g < len(partition_counts) else None
        experts = [split_expert_name(n) for n in names]
        if not any(experts):
            if pc != world:
                raise DeepSpeedLayoutError(f"{told_by}: param group {g} is partitioned over {pc} "
                                           f"ranks, not the {world} of the checkpoint, and holds "
                                           f"no expert parameters")
            replicas.append([(list(range(world)), list(names))])
            continue
        if not all(experts):
            odd = next(n for n, e in zip(names, experts) if not e)
            raise DeepSpeedLayoutError(f"{model.path}: param group {g} mixes expert and dense "
                                       f"parameters ({odd!r}); DeepSpeed keeps experts apart")
        if not pc or world % pc:
            raise DeepSpeedLayoutError(f"{told_by}: expert param group {g} is partitioned over "
                                       f"{pc} ranks, which does not divide the world of {world}")
        ep = world // pc
        local = {}  # layer prefix -> local expert ids
        for prefix, e, _ in experts:
            if prefix not in count_of:
                raise DeepSpeedLayoutError(f"{model.path}: MoE layer {prefix!r} has expert "
                                           f"parameters but no expert files")
            local.setdefault(prefix, set()).add(e)
        for prefix, ids in local.items():
            per_rank = count_of[prefix] // ep  # compared without building range(per_rank):
            # the count comes from a file, and may be absurd
            if count_of[prefix] % ep or len(ids) != per_rank or max(ids) != per_rank - 1:
                held = f"{min(ids)}..{max(ids)}" if len(ids) == max(ids) - min(ids) + 1 \
                    else short_repr(sorted(ids))
                raise DeepSpeedLayoutError(
                    f"{told_by}: MoE layer {prefix!r}: the optimizer partitions hold experts "
                    f"{held} per rank over {ep} expert-parallel ranks, but {model.path} "
                    f"says {count_of[prefix]} experts (expert counts differ between files)")
        reps = []
        for k, ranks in enumerate(ep_ranks(world, ep, data_first)):
            reps.append((ranks, [expert_name(p, k * (count_of[p] // ep) + e, rest)
                                 for p, e, rest in experts]))
        replicas.append(reps)
    # every trainable expert name, with its shape (that of expert-parallel rank 0's copy)
    shapes: dict[str, tuple[int, ...]] = {}
    for g, reps in enumerate(replicas):
        for _, names in reps:
            for name, local_name in zip(names, group_names[g]):
                shapes[name] = group_shapes[local_name]
    wanted = {n: s for n, s in shapes.items() if split_expert_name(n)}
    return ExpertLayout(replicas, shapes, _check_expert_files(files, prefixes, counts, wanted, tag_dir),
                        {p: count_of[p] for p in prefixes})


def _layer_prefixes(files: dict[tuple[int, int], str], tag_dir: str) -> list[str]:
    """The module prefix of each MoE layer 0..L-1, from its expert 0 file's names."""
    layers = sorted({layer for layer, _ in files})
    prefixes = []
    for layer in range(len(layers)):
        if layer not in layers:
            raise DeepSpeedLayoutError(f"{expert_file_name(tag_dir, layer, 0)}: missing expert file "
                                       f"(MoE layer {layer} of layers 0..{layers[-1]})")
        first = min(e for l, e in files if l == layer)
        pt = load_pt(files[(layer, first)])
        names = list(pt.obj) if isinstance(pt.obj, dict) else []
        parts = {split_expert_name(n)[0] for n in names if isinstance(n, str) and split_expert_name(n)}
        if len(parts) != 1:
            raise DeepSpeedLayoutError(f"{pt.path}: not a DeepSpeed expert file (expected the "
                                       f"weights of one expert, '<layer>{EXPERT_INFIX}<id>.<name>')")
        prefixes.append(parts.pop())
    return prefixes


def _check_expert_files(files, prefixes, counts, wanted, tag_dir) -> list[PtFile]:
    """Load every expert file, checking that each expert of each layer has one, holding
    exactly that expert's trainable parameters in the optimizer's shapes."""
    loaded = []
    for layer, (prefix, count) in enumerate(zip(prefixes, counts)):
        extra = sorted(e for l, e in files if l == layer and e >= count)
        if extra:
            raise DeepSpeedLayoutError(
                f"{files[(layer, extra[0])]}: unexpected expert file: the model states say MoE "
                f"layer {layer} has {count} experts (expert counts differ between files)")
        for e in range(count):
            path = files.get((layer, e))
            if path is None:
                raise DeepSpeedLayoutError(f"{expert_file_name(tag_dir, layer, e)}: missing expert "
                                           f"file (MoE layer {layer} {prefix!r} has {count} experts)")
            pt = load_pt(path)
            held = pt.obj if isinstance(pt.obj, dict) else {}
            mine = {n: s for n, s in wanted.items()
                    if split_expert_name(n)[:2] == (prefix, e)}
            for name, shape in mine.items():
                ref = held.get(name)
                if not isinstance(ref, TensorRef):
                    raise DeepSpeedLayoutError(f"{path}: expert parameter {name!r} missing")
                if tuple(ref.shape) != tuple(shape):
                    raise DeepSpeedLayoutError(f"{path}: {name} has shape {list(ref.shape)}, but the "
                                               f"optimizer partitions hold it as {list(shape)}")
            for name in held:
                if name not in mine:
                    raise DeepSpeedLayoutError(f"{path}: {short_repr(name)} is not a trainable "
                                               f"parameter of expert {e} of MoE layer {layer}")
            loaded.append(pt)
    return loaded
