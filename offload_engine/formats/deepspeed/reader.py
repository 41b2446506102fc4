"""A DeepSpeed ZeRO-1/2/3 checkpoint as a ``TensorSource``, without importing deepspeed.

What is read: the pickled structure of every rank file (``safe_unpickler``: no storage
bytes, no code run), then, on demand, byte ranges of the records that hold what a request
asks for. Tensors come out in zero_to_fp32's key order: buffers, frozen parameters,
trainable parameters; tied names (``shared_params``) are aliases of their owner.

States: a trainable parameter has ``master`` (its fp32 master weights, in
``single_partition_of_fp32_groups`` for ZeRO-1/2 or ``fp32_flat_groups`` for ZeRO-3) and,
where the files hold them for every partition, the Adam moments ``exp_avg`` and
``exp_avg_sq`` (and DeepSpeed Muon's ``momentum_buffer``): in every rank file the moments of param group (ZeRO-1/2) or sub-group
(ZeRO-3) ``g`` are flat tensors that cover that group's fp32 partition element for element
(a last rank's moments keep the tail padding its saved partition drops), so a parameter's
moment lies at the same elements of ``state[g]["exp_avg"]`` as its master weights in the
partition. ZeRO-1/2 Muon is the exception: each rank keeps the momentum of the whole
parameters overlapping its partition (``partitions.zero12_momentum_layout``). Frozen parameters (ZeRO-3 fragments, or ZeRO-1/2 module entries) and buffers
have ``param``.

Where the moments are (DeepSpeed 0.19): ZeRO-1/2 ``optimizer_state_dict
["base_optimizer_state"]`` is ``{"state": {g: {...}}, "param_groups": [...]}`` (older
releases: one dict per group); ZeRO-3 ``optimizer_state_dict["optimizer_state_dict"]``.

A read only touches records of the states it asks for: the reader merges neighbouring
ranges across small holes, but never across a record of another state, so consolidating
(master weights only) never reads a byte of the Adam moments.
"""

from __future__ import annotations

import math
import os
import struct

from ...dtypes import DType
from ...io.align import as_byte_view
from ..errors import FormatError
from ..pt_limits import MAX_EXTENT
from ..safe_unpickler import CheckpointFileError, PtFile, TensorRef, load_pt, short_repr
from ..source import ReadRequest, TensorSource, SourceInfo, StateMeta, TensorMeta
from .files import DeepSpeedLayoutError, check_rank_count, find_optim_files, model_files, resolve_tag_dir
from .experts import ExpertLayout, expert_layout, find_expert_files
from .autoep import assemble_experts, autoep_experts, zero3_partitions
from .partitions import (Piece, PartitionError, fragments_layout, zero3_replica_layout,
                         zero12_momentum_layout, zero12_replica_layout)
from .scatter_read import ScatterReader, Segment
from .model_states import buffer_names, shape_groups, shared_params, trimmed
from .segment_table import SegmentTable

MOMENTS = ("exp_avg", "exp_avg_sq")
# what the wrapped optimizer keeps per partition element: Adam's moments, and the momentum of
# DeepSpeed's ZeRO-3 Muon (MuonWithAuxAdam: ``state[sub-group]["momentum_buffer"]``, laid out
# like the sub-group's fp32 partition, in the communication dtype)
OPTIMIZER_STATES = MOMENTS + ("momentum_buffer",)


def _as_int(value, what: str, path: str) -> int:
    value = getattr(value, "value", value)  # ZeroStageEnum arrives as an inert stand-in
    if isinstance(value, bool) or not isinstance(value, int):
        raise DeepSpeedLayoutError(f"{path}: {what} is {short_repr(value)}, expected an integer")
    return value


def _paddings(pads, path: str) -> list[list[int]] | None:
    """``param_alignment_paddings``: per param group, per parameter, elements of padding
    (ints in [0, 2**63)); None when absent."""
    if pads is None:
        return None
    if isinstance(pads, (list, tuple)) and all(
            isinstance(g, (list, tuple)) and all(type(p) is int and 0 <= p <= MAX_EXTENT for p in g)
            for g in pads):
        return [list(g) for g in pads]
    raise DeepSpeedLayoutError(f"{path}: 'param_alignment_paddings' is {short_repr(pads)}, "
                               f"expected a list per param group of padding element counts")


def _optimizer_state(pt: PtFile) -> dict:
    obj = pt.obj
    osd = obj.get("optimizer_state_dict") if isinstance(obj, dict) else None
    if not isinstance(osd, dict):
        raise DeepSpeedLayoutError(f"{pt.path}: no 'optimizer_state_dict'; not a DeepSpeed optimizer file")
    if "zero_stage" not in osd:
        raise DeepSpeedLayoutError(f"{pt.path}: no 'zero_stage'; not a ZeRO checkpoint (ZeRO stage 0 and "
                                   f"the bf16 optimizer without ZeRO are not supported)")
    return osd


def _tensor_list(pt: PtFile, container: dict, key: str) -> list[TensorRef]:
    refs = container.get(key)
    if not isinstance(refs, (list, tuple)) or not all(isinstance(r, TensorRef) for r in refs):
        raise DeepSpeedLayoutError(f"{pt.path}: '{key}' is missing or not a list of tensors")
    return list(refs)


def _inner_state(osd: dict, stage: int):
    """The wrapped torch optimizer's state dict: (state {index: {name: ref}}, param_groups)."""
    base = osd.get("base_optimizer_state" if stage <= 2 else "optimizer_state_dict")
    if isinstance(base, dict):
        state = base.get("state")
        groups = base.get("param_groups")
        return (state if isinstance(state, dict) else {}), (groups if isinstance(groups, (list, tuple)) else [])
    if isinstance(base, (list, tuple)):  # older ZeRO-1/2: one state dict per group
        return {g: s for g, s in enumerate(base) if isinstance(s, dict)}, []
    return {}, []


def _optimizer_kind(param_groups, has_second_moment: bool) -> str | None:
    if not has_second_moment:
        return None
    for g in param_groups or []:
        if isinstance(g, dict) and g.get("decoupled_weight_decay"):
            return "adamw"
    return "adam"


def _group_of_source(param_groups) -> dict[int, dict]:
    """{flat group or ZeRO-3 sub-group index: the saved param group that holds it}."""
    out = {}
    for group in param_groups or []:
        if isinstance(group, dict):
            for index in group.get("params") or []:
                if isinstance(index, int):
                    out[index] = group
    return out


def _step_value(pt: PtFile, step) -> float | None:
    """Adam's step count as saved: an int, or a one-element tensor (torch.optim.AdamW)."""
    if isinstance(step, (int, float)) and not isinstance(step, bool):
        return float(step)
    if isinstance(step, TensorRef) and step.numel == 1 and step.dtype.kind == "float":
        offset, nbytes = pt.tensor_span(step)
        with open(pt.path, "rb") as f:
            raw = os.pread(f.fileno(), nbytes, offset)
        fmt = {4: "<f", 8: "<d"}.get(nbytes)
        return float(struct.unpack(fmt, raw)[0]) if fmt and len(raw) == nbytes else None
    return None


class DeepSpeedSource(TensorSource):
    """Tensors of a DeepSpeed checkpoint folder, read lazily by element range.

    Args:
        root: the checkpoint folder (holding ``latest`` and the tag folders).
        tag: the tag folder to read; default: the content of ``latest``.
        threads: reads in flight at once (pieces of up to 8 MiB, from any of the files).
    """

    def __init__(self, root: str, tag: str | None = None, threads: int = 8):
        self.root = os.path.abspath(root)
        self.tag, self.tag_dir = resolve_tag_dir(root, tag)
        optim = find_optim_files(self.tag_dir)
        if 0 not in optim.by_rank:
            raise DeepSpeedLayoutError(f"{optim.path(0)}: missing rank file (rank 0)")
        first = load_pt(optim.by_rank[0])
        osd0 = _optimizer_state(first)
        self.stage = _as_int(osd0["zero_stage"], "zero_stage", first.path)
        if self.stage not in (1, 2, 3):
            raise DeepSpeedLayoutError(f"{first.path}: unsupported ZeRO stage {self.stage}")
        count = osd0.get("partition_count")
        counts = count if isinstance(count, (list, tuple)) and count else [count]
        self.world_size = max(_as_int(c, "partition_count", first.path) for c in counts)
        paths = check_rank_count(optim, self.world_size, first.path)
        self.bf16 = optim.bf16
        self._optims = [first] + [load_pt(p) for p in paths[1:]]
        # one at a time, each trimmed to what is read of it before the next is loaded
        self._models = [trimmed(load_pt(p), r, self.stage) for r, p in
                        enumerate(model_files(self.tag_dir, self.stage, self.world_size))]
        self._files: list[PtFile] = self._optims + self._models
        self._expert_files: list[PtFile] = []  # an MoE run's per-expert model states
        self.experts: dict[str, int] = {}  # an MoE run's layers (module prefix) -> expert count
        for pt in self._optims[1:]:
            stage = _as_int(_optimizer_state(pt)["zero_stage"], "zero_stage", pt.path)
            if stage != self.stage:
                raise DeepSpeedLayoutError(f"{pt.path}: ZeRO stage {stage}, but rank 0 has {self.stage}")
        model0 = self._models[0].obj
        version = model0.get("ds_version")
        # shown in summaries: a string as it is, anything else as a bounded repr
        self.ds_version = version if isinstance(version, str) and len(version) <= 100 else short_repr(version)
        self.global_steps = model0.get("global_steps")
        # the engine's own progress, as saved (plain values: the LR scheduler's state_dict)
        self.run_state = {k: model0.get(k) for k in ("global_steps", "global_samples",
                                                     "skipped_steps", "lr_scheduler")}
        if self.stage <= 2 and (model0.get("ds_autoep_layers") or model0.get("autoep_layers")):
            # expert parameters are partitioned over expert groups, not the data-parallel
            # world: merging them like the rest would give wrong tensors
            raise DeepSpeedLayoutError(f"{self._models[0].path}: expert-parallel (AutoEP) "
                                       f"checkpoints under ZeRO-{self.stage} are not supported, "
                                       f"only under ZeRO-3")

        self._tensors: list[TensorMeta] = []
        # (tensor, state) -> its segments and bytes per element
        self._segments = SegmentTable()
        # equal StateMeta, states and extra dicts shared between tensors (thousands of
        # experts of one shape): ``_shared``
        self._interned: dict = {}
        self._steps: dict = {}  # (file, storage key) -> Adam's step read from it
        self._used: dict[str, list[set[str]]] = {}  # state -> per file, storage keys it reads
        self._forbidden: dict[frozenset, list] = {}
        self._notes: list[str] = []
        self.optimizer: str | None = None
        self._add_buffers(model0)
        self._add_frozen(model0)
        self._add_trainable(model0)
        names = {t.name for t in self._tensors}
        shared = shared_params(self._models[0])
        self._aliases = {a: o for a, o in shared.items() if o in names and a not in names}
        # not capped at the file count: the reader cuts long runs into pieces read in parallel
        self._reader = ScatterReader([pt.path for pt in self._files], threads=threads)
        self.info = SourceInfo(
            kind="deepspeed", path=self.root,
            format=f"DeepSpeed ZeRO-{self.stage}" + (" bf16" if self.bf16 else "")
            + f", deepspeed {self.ds_version}",
            step=self.global_steps if type(self.global_steps) is int else None,
            generation=self.tag, world_size=self.world_size,
            files=[(pt.path, os.path.getsize(pt.path))
                   for pt in sorted(self._files + self._expert_files, key=lambda f: f.path)])
        self.info.notes += self._notes
        if self._tensors and not any("exp_avg" in t.states for t in self._tensors):
            self.info.notes.append("no Adam moments in the optimizer files")

    # -- building the tensor list ----------------------------------------------------------
    def _segments_of(self, name: str, state: str, pieces: list[Piece], refs: dict,
                     home: PtFile) -> tuple[DType, dict]:
        """Record where ``state`` of tensor ``name`` lies (``pieces`` of the source tensors
        ``refs``: key -> (file index, TensorRef)); returns its dtype and bytes per rank."""
        if (name, state) in self._segments:
            raise DeepSpeedLayoutError(f"{home.path}: tensor {short_repr(name)} is listed twice")
        dtypes = {refs[p.src][1].dtype for p in pieces}
        if len(dtypes) > 1:
            raise DeepSpeedLayoutError(f"{home.path}: {name} is stored in mixed dtypes "
                                       f"{sorted(map(str, dtypes))}")
        dtype = dtypes.pop() if dtypes else next(iter(refs.values()))[1].dtype
        size = dtype.itemsize
        used = self._used.setdefault(state, [set() for _ in self._files])
        segments, per_rank = [], {}
        for p in pieces:
            file, ref = refs[p.src]
            pt = self._files[file]
            if p.src_offset + p.count > ref.numel:
                raise DeepSpeedLayoutError(f"{pt.path}: {name} needs elements past the end of its "
                                           f"{ref.numel}-element {state} partition (corrupt or "
                                           f"mixed files)")
            base, _ = pt.tensor_span(ref)
            segments.append(Segment(p.start, p.count, file, base + p.src_offset * size))
            used[file].add(ref.storage.key)
            rank = file if file < len(self._optims) else file - len(self._optims)
            per_rank[rank] = per_rank.get(rank, 0) + p.count * size
        self._segments.add(name, state, segments, size)
        return dtype, per_rank

    def _model_index(self, rank: int) -> int:
        return len(self._optims) + rank

    def _add_whole(self, name: str, shape, kind: str, pieces, refs, home: PtFile) -> None:
        """A buffer or frozen parameter: one state, ``param``, listed as unsharded (ZeRO-3
        fragments included: no optimizer partitions them)."""
        dtype, per_rank = self._segments_of(name, "param", pieces, refs, home)
        shape = tuple(int(s) for s in shape)
        state = self._state_meta(dtype, math.prod(shape), {None: sum(per_rank.values())})
        self._tensors.append(TensorMeta(name, shape, dtype, None, self._shared({"param": state}),
                                        kind=kind))

    def _add_buffers(self, model0: dict) -> None:
        module = model0["module"]
        home = self._models[0]
        for name in buffer_names(home):
            ref = module.get(name)
            if not isinstance(ref, TensorRef):
                raise DeepSpeedLayoutError(f"{home.path}: buffer {short_repr(name)} missing from 'module'")
            self._add_whole(name, ref.shape, "buffer", [Piece(0, ref.numel, "b", 0)],
                            {"b": (self._model_index(0), ref)}, home)

    def _add_frozen(self, model0: dict) -> None:
        shapes = model0.get("frozen_param_shapes")
        if shapes is None and self.stage <= 2:
            self._add_frozen_from_module(model0)
            return
        shapes = {n: shape for g in shape_groups(self._models[0], "frozen_param_shapes")
                  for n, shape in g.items()} if shapes is not None else {}
        for name, shape in shapes.items():
            numel = math.prod(shape)
            refs = {}
            for r, model in enumerate(self._models):  # one file for ZeRO-1/2, one per rank for ZeRO-3
                frags = model.obj.get("frozen_param_fragments") or {}
                ref = frags.get(name) if isinstance(frags, dict) else None
                if not isinstance(ref, TensorRef):
                    raise DeepSpeedLayoutError(f"{model.path}: frozen parameter {short_repr(name)} has no fragment")
                refs[r] = (self._model_index(r), ref)
            try:
                pieces = fragments_layout(numel, [(r, refs[r][1].numel) for r in sorted(refs)])
            except PartitionError as e:
                raise DeepSpeedLayoutError(f"{self._models[0].path}: frozen {name}: {e}") from None
            self._add_whole(name, shape, "frozen", pieces, refs, self._models[0])

    def _add_frozen_from_module(self, model0: dict) -> None:
        """ZeRO-1 checkpoints record no ``frozen_param_shapes`` (zero_to_fp32 then drops
        frozen parameters). Under ZeRO-1/2 the module state dict holds every parameter whole,
        so a frozen one is an entry that is neither trainable, a buffer, nor a tied alias."""
        groups = shape_groups(self._models[0], "param_shapes")
        skip = {n for g in groups for n in g} | set(buffer_names(self._models[0])) \
            | set(shared_params(self._models[0]))
        home = self._models[0]
        for name, ref in model0["module"].items():
            if name in skip or not isinstance(ref, TensorRef):
                continue
            self._add_whole(name, ref.shape, "frozen", [Piece(0, ref.numel, "f", 0)],
                            {"f": (self._model_index(0), ref)}, home)

    def _add_trainable(self, model0: dict) -> None:
        groups = shape_groups(self._models[0], "param_shapes")
        params = [[(n, math.prod(s)) for n, s in g.items()] for g in groups]
        shapes = {n: tuple(int(d) for d in s) for g in groups for n, s in g.items()}
        key = "single_partition_of_fp32_groups" if self.stage <= 2 else "fp32_flat_groups"
        osds = [_optimizer_state(pt) for pt in self._optims]
        masters = [_tensor_list(pt, osd, key) for pt, osd in zip(self._optims, osds)]
        home = self._optims[0]
        try:
            if self.stage <= 2:
                for pt, lst in zip(self._optims, masters):
                    if len(lst) != len(params):
                        raise DeepSpeedLayoutError(f"{pt.path}: {len(lst)} fp32 partitions but the model "
                                                   f"states list {len(params)} param groups")
                pads = _paddings(osds[0].get("param_alignment_paddings"), self._optims[0].path)
                if pads is not None and len(pads) != len(params):
                    raise DeepSpeedLayoutError(f"{self._optims[0].path}: {len(pads)} groups of "
                                               f"alignment paddings for {len(params)} param groups")
                if pads is not None and not any(any(p) for p in pads):
                    pads = None  # all zero: the common case, parameters back to back
                moe = self._expert_layout(groups, osds[0])
                shapes = moe.shapes
                numel = {n: math.prod(s) for n, s in shapes.items()}
                layout = zero12_replica_layout(
                    [[(ranks, [(n, numel[n]) for n in names]) for ranks, names in copies]
                     for copies in moe.replicas],
                    [[ref.numel for ref in lst] for lst in masters], pads)
                layout = {n: layout[n] for n in moe.ordered(list(layout))}
            else:
                if find_expert_files(self.tag_dir):
                    raise DeepSpeedLayoutError(f"{self.tag_dir}: per-expert files in a ZeRO-3 checkpoint; "
                                               f"DeepSpeed's native MoE does not run under ZeRO-3")
                numels = [[ref.numel for ref in lst] for lst in masters]
                copies = zero3_replica_layout([p for g in params for p in g], numels,
                                              zero3_partitions(self._optims, osds, [len(n) for n in numels]))
                layout = {}
                for name, held in copies.items():  # AutoEP experts: one copy per partition group
                    shapes[name], layout[name] = assemble_experts(name, shapes[name], held, self._models)
                del copies
                self.experts = autoep_experts(self._models[0])
                if self.experts:
                    self._notes.append("AutoEP mixture-of-experts: " + ", ".join(
                        f"{p} {n} experts" for p, n in self.experts.items())
                        + "; grouped [experts, out, in] under DeepSpeed's names")
        except PartitionError as e:
            raise DeepSpeedLayoutError(f"{self.tag_dir}: ZeRO-{self.stage} partitions do not match the "
                                       f"parameter shapes: {e}") from None
        refs = {"master": {(r, g): (r, ref) for r, lst in enumerate(masters)
                           for g, ref in enumerate(lst)}}
        inner, hyper = [], None
        for osd in osds:
            state, param_groups = _inner_state(osd, self.stage)
            inner.append(state)
            hyper = hyper or param_groups
        self.param_groups = hyper or []
        self._stage12_momentum = None
        # ZeRO-1/2 Muon keeps whole parameters' momentum per rank, not the partition's
        # elements: its own layout (None: this is not such a run)
        layouts = {}
        if self.stage <= 2:
            layouts["momentum_buffer"], momentum_numels = zero12_momentum_layout(layout)
        for moment in OPTIMIZER_STATES:
            found = {}
            for r, lst in enumerate(masters):
                for g, master in enumerate(lst):
                    group_state = inner[r].get(g)
                    ref = group_state.get(moment) if isinstance(group_state, dict) else None
                    if not isinstance(ref, TensorRef):
                        continue
                    if moment in layouts:
                        if ref.numel != momentum_numels.get((r, g), 0):
                            # not the layout above: never read as momentum (the first found)
                            self._stage12_momentum = self._stage12_momentum or (
                                f"{self._optims[r].path}: param group {g}'s Muon momentum "
                                f"holds {ref.numel} elements, but the parameters overlapping "
                                f"rank {r}'s partition hold {momentum_numels.get((r, g), 0)} "
                                f"(a ZeRO-{self.stage} momentum layout this reader does not know)")
                            break
                        found[(r, g)] = (r, ref)
                    elif ref.numel >= master.numel:
                        found[(r, g)] = (r, ref)
            if moment in layouts and self._stage12_momentum is not None:
                continue
            if found:
                refs[moment] = found
        states_of: dict[str, dict[str, StateMeta]] = {name: {} for name in layout}
        for state, by_src in refs.items():
            # a state covers the tensors whose every piece lies in a partition that holds it
            # (a Muon run: momentum_buffer in the Muon sub-groups, the moments in the others)
            covered = {name: pieces for name, pieces in layouts.get(state, layout).items()
                       if all(p.src in by_src for p in pieces)}
            try:
                found = {}
                for name, pieces in covered.items():
                    dtype, per_rank = self._segments_of(name, state, pieces, by_src, home)
                    found[name] = self._state_meta(dtype, math.prod(shapes[name]), per_rank)
            except (DeepSpeedLayoutError, CheckpointFileError) as e:
                if state == "master":
                    raise
                # the moments only matter to inspect, diff and export: a checkpoint whose
                # moments cannot be mapped still consolidates, and says why they are missing
                self._forget(state)
                self._notes.append(f"Adam {state} not readable: {e}")
                continue
            for name, meta in found.items():
                states_of[name][state] = meta
            del found, covered
        self.optimizer = _optimizer_kind(hyper, all("exp_avg_sq" in s for s in states_of.values()))
        group_of = _group_of_source(hyper)
        for name, pieces in layout.items():
            states = states_of[name]
            kind = "muon" if "momentum_buffer" in states else (
                self.optimizer or ("adamw" if "exp_avg_sq" in states else None))
            meta = TensorMeta(name, shapes[name], states["master"].dtype, kind, self._shared(states))
            if pieces:  # what the optimizer recorded for this parameter's group
                src = pieces[0].src
                group = group_of.get(src[1])
                if group is not None and "use_muon" in group:
                    meta.extra["use_muon"] = bool(group["use_muon"])
                if group is not None:
                    meta.extra["group"] = hyper.index(group)
                group_state = inner[src[0]].get(src[1])
                step = self._step(src[0], group_state.get("step")
                                  if isinstance(group_state, dict) else None)
                if step is not None and "exp_avg" in meta.states:
                    meta.extra["adam_step"] = step
                meta.extra = self._shared(meta.extra)
            self._tensors.append(meta)

    def _expert_layout(self, groups: list[dict], osd0: dict) -> ExpertLayout:
        """Which ranks partition each ZeRO-1/2 param group, under which names (an MoE
        run's expert groups: see ``experts.py``), with its expert files checked."""
        path = self._optims[0].path
        count = osd0.get("partition_count")
        counts = count if isinstance(count, (list, tuple)) else [count] * len(groups)
        counts = [_as_int(c, "partition_count", path) for c in counts]
        moe = expert_layout(self.tag_dir, self._models[0], [list(g) for g in groups],
                            {n: s for g in groups for n, s in g.items()}, counts,
                            self.world_size, path)
        for pt in self._optims[1:]:
            other = _optimizer_state(pt).get("partition_count")
            if moe.experts and other != count:
                raise DeepSpeedLayoutError(f"{pt.path}: partition_count {short_repr(other)}, but "
                                           f"{path} has {short_repr(count)} (expert counts or "
                                           f"expert-parallel sizes differ between files)")
        self.experts = dict(moe.experts)
        if moe.experts:
            self._expert_files = moe.expert_files  # listed, never read: the masters are in the partitions
            self._notes.append(
                "mixture-of-experts: " + ", ".join(f"{p} {n} experts" for p, n in moe.experts.items())
                + "; experts keep DeepSpeed's per-expert names, with global expert ids")
        return moe

    def _forget(self, state: str) -> None:
        """Drop every segment of ``state`` (it could not be mapped for some tensor)."""
        self._segments.forget(state)
        self._used.pop(state, None)

    def _shared(self, mapping: dict) -> dict:
        """An equal dict made before (a tensor's ``states`` or ``extra``), else ``mapping``:
        thousands of tensors of one shape then hold one. Nothing changes them once built."""
        key = ("dict",) + tuple((k, id(v) if isinstance(v, StateMeta) else v)
                                for k, v in mapping.items())
        return self._interned.setdefault(key, mapping)

    def _state_meta(self, dtype: DType, numel: int, per_rank: dict) -> StateMeta:
        """A StateMeta, shared with every equal one."""
        key = ("state", dtype.name, numel) + tuple(per_rank.items())
        meta = self._interned.get(key)
        if meta is None:
            meta = self._interned[key] = StateMeta(dtype, numel, per_rank)
        return meta

    def _step(self, rank: int, step) -> float | None:
        """Adam's step count saved in rank ``rank``'s optimizer file (one read per record)."""
        key = (rank, step.storage.key) if isinstance(step, TensorRef) else None
        if key is None:
            return _step_value(self._optims[rank], step)
        if key not in self._steps:
            self._steps[key] = _step_value(self._optims[rank], step)
        return self._steps[key]

    def _forbidden_for(self, states: frozenset) -> list[list[tuple[int, int]]]:
        """Per file, the byte spans of storage records no tensor's ``states`` live in: the
        reader never bridges a hole through them."""
        spans = self._forbidden.get(states)
        if spans is None:
            spans = []
            for f, pt in enumerate(self._files):
                used = set().union(*(self._used.get(s, [set()] * len(self._files))[f] for s in states))
                spans.append(sorted((offset, offset + nbytes)
                                    for k, offset, nbytes in pt.archive.storage_records()
                                    if k not in used and nbytes))
            self._forbidden[states] = spans
        return spans

    # -- TensorSource ----------------------------------------------------------------------
    def tensors(self) -> list[TensorMeta]:
        return list(self._tensors)

    def aliases(self) -> dict[str, str]:
        return dict(self._aliases)

    def read(self, requests) -> None:
        """Fill every request, one batch of reads for all (requests of several states
        may bridge holes only through records of those states)."""
        wants, states = [], set()
        for req in requests:
            name = self._aliases.get(req.name, req.name)
            state = req.state or ("master" if (name, "master") in self._segments else "param")
            found = self._segments.lookup(name, state)
            if found is None:
                if not self._segments.has_tensor(name):
                    raise FormatError(f"{self.tag_dir}: no tensor {req.name!r}")
                raise FormatError(f"{self.tag_dir}: tensor {req.name!r} has no state {state!r}")
            wants += self._segments.wants(found, req.start, as_byte_view(req.out),
                                          f"{req.name}/{state}")
            states.add(state)
        self._reader.read(wants, self._forbidden_for(frozenset(states)))

    @property
    def reader(self) -> ScatterReader:
        return self._reader

    @property
    def stage12_momentum(self) -> str | None:
        """Why ZeRO-1/2 Muon momentum could not be mapped (naming the rank file: its size
        is not that of the whole parameters overlapping the rank's partition), or None."""
        return self._stage12_momentum

    def describe(self) -> str:
        return (f"DeepSpeed ZeRO-{self.stage} checkpoint {self.tag_dir} (world size {self.world_size}"
                f"{', bf16' if self.bf16 else ''}, deepspeed {self.ds_version})")

    def close(self) -> None:
        self._reader.close()


__all__ = ["CheckpointFileError", "DeepSpeedLayoutError", "DeepSpeedSource", "ReadRequest"]
