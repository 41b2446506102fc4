"""Optimizer states of a DeepSpeed ZeRO-1/2/3 checkpoint per parameter: the fp32 master
partitions and the Adam moments (``exp_avg``, ``exp_avg_sq``), for inspection.

``DeepSpeedSource`` (what ``consolidate`` reads) never touches the moments. Inspection
needs them, so this module maps them with the same partition arithmetic (``layout``): in
every rank file the moments of param group (ZeRO-1/2) or sub-group (ZeRO-3) ``g`` are flat
tensors that cover that group's fp32 partition element for element (a last rank's moments
keep the tail padding its saved partition drops), so a parameter's moment lies at the same
elements of ``state[g]["exp_avg"]`` as its master weights do in
``single_partition_of_fp32_groups[g]`` / ``fp32_flat_groups[g]``.

Where they are (DeepSpeed 0.19): ZeRO-1/2 ``optimizer_state_dict["base_optimizer_state"]``
is ``{"state": {g: {...}}, "param_groups": [...]}`` (older releases: a list with one dict
per group); ZeRO-3 ``optimizer_state_dict["optimizer_state_dict"]`` is
``{"state": {g: {...}}, "param_groups": [...]}``. Structure comes from the same restricted
unpickler; data is read by byte range only when asked for.
"""

from __future__ import annotations

import math

from offload_engine.io.align import as_byte_view

from ..safe_unpickler import PtFile, TensorRef, load_pt
from .files import DeepSpeedLayoutError, check_rank_count, find_optim_files, model_files
from .layout import LayoutError, zero3_layout, zero12_layout
from .scatter_read import ScatterReader, Segment, segment_wants
from .source import _as_int, _optimizer_state, _tensor_list

MOMENTS = ("exp_avg", "exp_avg_sq")
STATES = ("master",) + MOMENTS


def _inner_state(pt: PtFile, osd: dict, stage: int):
    """The wrapped torch optimizer's state dict: (state {index: {name: ref}}, param_groups)."""
    base = osd.get("base_optimizer_state" if stage <= 2 else "optimizer_state_dict")
    if isinstance(base, dict):
        state = base.get("state")
        return (state if isinstance(state, dict) else {}), base.get("param_groups") or []
    if isinstance(base, (list, tuple)):  # older ZeRO-1/2: one state dict per group
        return {g: s for g, s in enumerate(base) if isinstance(s, dict)}, []
    return {}, []


class DeepSpeedOptimStates:
    """Master weights and Adam moments of every trainable parameter, by element range.

    Args:
        tag_dir: the tag folder (e.g. ``ckpt/global_step14``).
        threads: files read in parallel.
    """

    def __init__(self, tag_dir: str, threads: int = 4):
        optim = find_optim_files(tag_dir)
        if 0 not in optim.by_rank:
            raise DeepSpeedLayoutError(f"{optim.path(0)}: missing rank file (rank 0)")
        first = load_pt(optim.by_rank[0])
        osd0 = _optimizer_state(first)
        self.stage = _as_int(osd0["zero_stage"], "zero_stage", first.path)
        count = osd0.get("partition_count")
        counts = count if isinstance(count, (list, tuple)) else [count]
        self.world_size = max(_as_int(c, "partition_count", first.path) for c in counts)
        paths = check_rank_count(optim, self.world_size, first.path)
        self._optims = [first] + [load_pt(p) for p in paths[1:]]
        model0 = load_pt(model_files(tag_dir, self.stage, self.world_size)[0]).obj
        self.global_steps = model0.get("global_steps") if isinstance(model0, dict) else None
        groups = model0["param_shapes"]
        groups = [groups] if isinstance(groups, dict) else groups
        self.shapes = {n: tuple(int(d) for d in s) for g in groups for n, s in g.items()}
        params = [[(n, math.prod(s)) for n, s in g.items()] for g in groups]

        key = "single_partition_of_fp32_groups" if self.stage <= 2 else "fp32_flat_groups"
        masters, inner, hyper = [], [], None
        for pt in self._optims:
            osd = _optimizer_state(pt)
            masters.append(_tensor_list(pt, osd, key))
            state, param_groups = _inner_state(pt, osd, self.stage)
            inner.append(state)
            hyper = hyper or param_groups
        refs: dict[str, dict] = {"master": {}}
        for r, lst in enumerate(masters):
            for g, ref in enumerate(lst):
                refs["master"][(r, g)] = ref
        for name in MOMENTS:
            found = {}
            for r, lst in enumerate(masters):
                for g, master in enumerate(lst):
                    ref = (inner[r].get(g) or {}).get(name)
                    if isinstance(ref, TensorRef) and ref.numel >= master.numel:
                        found[(r, g)] = ref
            if len(found) == len(refs["master"]):  # every partition has it
                refs[name] = found
        self.states = tuple(refs)
        self.optimizer = _optimizer_kind(hyper, "exp_avg_sq" in refs)
        self.hyperparams = [{k: g.get(k) for k in ("lr", "betas", "eps", "weight_decay")}
                            for g in hyper if isinstance(g, dict)]

        numels = [[ref.numel for ref in lst] for lst in masters]
        try:
            if self.stage <= 2:
                pads = osd0.get("param_alignment_paddings")
                if pads is not None and not any(any(p) for p in pads):
                    pads = None
                layout = zero12_layout(params, numels, pads)
            else:
                layout = zero3_layout([p for g in params for p in g], numels)
        except LayoutError as e:
            raise DeepSpeedLayoutError(f"{tag_dir}: ZeRO-{self.stage} partitions do not match the "
                                       f"parameter shapes: {e}") from None
        self._segments: dict[tuple[str, str], list[Segment]] = {}  # file: the rank
        self.bytes_by_rank: dict[tuple[str, str], dict[int, int]] = {}
        for state, by_src in refs.items():
            for name, pieces in layout.items():
                segs, per_rank = [], {}
                for p in pieces:
                    ref = by_src[p.src]
                    rank = p.src[0]
                    size = ref.dtype.itemsize
                    if p.src_offset + p.count > ref.numel:
                        raise DeepSpeedLayoutError(f"{self._optims[rank].path}: {name} needs "
                                                   f"elements past its {state} partition")
                    base, _ = self._optims[rank].tensor_span(ref)
                    segs.append(Segment(p.start, p.count, rank, base + p.src_offset * size))
                    per_rank[rank] = per_rank.get(rank, 0) + p.count * size
                segs.sort(key=lambda s: s.start)
                self._segments[(name, state)] = segs
                self.bytes_by_rank[(name, state)] = per_rank
        self.dtypes = {s: next(iter(by_src.values())).dtype for s, by_src in refs.items()}
        # Inspection may read any record, so no span is forbidden here.
        self._reader = ScatterReader([pt.path for pt in self._optims], [[] for _ in self._optims],
                                     threads=min(threads, len(self._optims)))

    @property
    def paths(self) -> list[str]:
        return [pt.path for pt in self._optims]

    def read(self, name: str, state: str, start: int, out) -> None:
        """Elements ``[start, start + len(out))`` of parameter ``name``'s ``state`` into
        ``out`` (1-D, a numpy array or a CPU torch tensor of the state's dtype)."""
        segments = self._segments.get((name, state))
        if segments is None:
            raise KeyError(f"no state {state!r} of parameter {name!r}")
        self._reader.read(segment_wants(segments, start, as_byte_view(out),
                                        self.dtypes[state].itemsize, f"{name}/{state}"))

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> "DeepSpeedOptimStates":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _optimizer_kind(param_groups, has_second_moment: bool) -> str | None:
    if not has_second_moment:
        return None
    for g in param_groups or []:
        if isinstance(g, dict) and g.get("decoupled_weight_decay"):
            return "adamw"
    return "adam"
