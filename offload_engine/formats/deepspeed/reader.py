"""A DeepSpeed ZeRO-1/2/3 checkpoint as a ``TensorSource``, without importing deepspeed.

What is read: the pickled structure of every rank file (``safe_unpickler``, no storage
bytes), then, on demand, only byte ranges of the fp32 master partitions
(``single_partition_of_fp32_groups`` / ``fp32_flat_groups``), of the frozen parameter
fragments and of the buffers. The Adam moments are never read: their storage records are
passed to the reader as forbidden spans, and the reader only reads the ranges of the
records listed above (plus holes between them that hold no other record).

Tensors come out in zero_to_fp32's key order: buffers, frozen parameters, trainable
parameters; tied names (``shared_params``) are aliases of their owner.
"""

from __future__ import annotations

import math

from offload_engine.io.align import as_byte_view

from ..consolidate import ReadRequest, TensorInfo
from ..safe_unpickler import CheckpointFileError, PtFile, TensorRef, load_pt
from .files import DeepSpeedLayoutError, check_rank_count, find_optim_files, model_files, resolve_tag_dir
from .layout import LayoutError, Piece, fragments_layout, zero3_layout, zero12_layout
from .scatter_read import ScatterReader, Segment, segment_wants


def _as_int(value, what: str, path: str) -> int:
    value = getattr(value, "value", value)  # ZeroStageEnum arrives as an inert stand-in
    if isinstance(value, bool) or not isinstance(value, int):
        raise DeepSpeedLayoutError(f"{path}: {what} is {value!r}, expected an integer")
    return value


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


class DeepSpeedSource:
    """Tensors of a DeepSpeed checkpoint folder, read lazily by element range.

    Args:
        root: the checkpoint folder (holding ``latest`` and the tag folders).
        tag: the tag folder to read; default: the content of ``latest``.
        exclude_frozen: leave out parameters without gradient.
        threads: reads in flight at once (pieces of up to 8 MiB, from any of the files).
    """

    def __init__(self, root: str, tag: str | None = None, exclude_frozen: bool = False, threads: int = 8):
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
        counts = count if isinstance(count, (list, tuple)) else [count]
        self.world_size = max(_as_int(c, "partition_count", first.path) for c in counts)
        paths = check_rank_count(optim, self.world_size, first.path)
        self.bf16 = optim.bf16
        self._optims = [first] + [load_pt(p) for p in paths[1:]]
        self._models = [load_pt(p) for p in model_files(self.tag_dir, self.stage, self.world_size)]
        self._files: list[PtFile] = self._optims + self._models
        for pt in self._optims[1:]:
            stage = _as_int(_optimizer_state(pt)["zero_stage"], "zero_stage", pt.path)
            if stage != self.stage:
                raise DeepSpeedLayoutError(f"{pt.path}: ZeRO stage {stage}, but rank 0 has {self.stage}")
        model0 = self._models[0].obj
        if not isinstance(model0, dict) or "param_shapes" not in model0 or "module" not in model0:
            raise DeepSpeedLayoutError(f"{self._models[0].path}: not a DeepSpeed model states file "
                                       f"(no 'param_shapes' / 'module')")
        self.ds_version = model0.get("ds_version")
        if model0.get("ds_autoep_layers") or model0.get("autoep_layers"):
            # expert parameters are partitioned over expert groups, not the data-parallel
            # world: merging them like the rest would give wrong tensors
            raise DeepSpeedLayoutError(f"{self._models[0].path}: expert-parallel (AutoEP) "
                                       f"checkpoints are not supported")

        self._infos: list[TensorInfo] = []
        self._segments: dict[str, tuple[list[Segment], int]] = {}  # and bytes per element
        self._used_keys: list[set[str]] = [set() for _ in self._files]
        self._add_buffers(model0)
        if not exclude_frozen:
            self._add_frozen(model0)
        self._add_trainable(model0)
        names = {i.name for i in self._infos}
        shared = model0.get("shared_params") or {}
        self._aliases = {a: o for a, o in shared.items() if o in names and a not in names}
        # not capped at the file count: the reader cuts long runs into pieces read in parallel
        self._reader = ScatterReader([pt.path for pt in self._files], self._forbidden_spans(),
                                     threads=threads)

    # -- building the tensor list ----------------------------------------------------------
    def _add(self, name: str, shape, kind: str, pieces: list[Piece], refs: dict, home: PtFile) -> None:
        """Register a tensor made of ``pieces``; ``refs`` maps a piece's source key to
        (file index, TensorRef)."""
        if name in self._segments:
            raise DeepSpeedLayoutError(f"{home.path}: tensor {name!r} is listed twice")
        shape = tuple(int(s) for s in shape)
        dtypes = {refs[p.src][1].dtype for p in pieces}
        if len(dtypes) > 1:
            raise DeepSpeedLayoutError(f"{home.path}: {name} is stored in mixed dtypes {dtypes}")
        dtype = dtypes.pop() if dtypes else next(iter(refs.values()))[1].dtype
        itemsize = dtype.itemsize
        segments = []
        for p in pieces:
            file, ref = refs[p.src]
            pt = self._files[file]
            if p.src_offset + p.count > ref.numel:
                raise DeepSpeedLayoutError(f"{pt.path}: {name} needs elements past the end of its "
                                           f"{ref.numel}-element partition (corrupt or mixed files)")
            base, _ = pt.tensor_span(ref)
            segments.append(Segment(p.start, p.count, file, base + p.src_offset * itemsize))
            self._used_keys[file].add(ref.storage.key)
        segments.sort(key=lambda s: s.start)
        self._segments[name] = (segments, itemsize)
        self._infos.append(TensorInfo(name, shape, dtype, kind))

    def _model_index(self, rank: int) -> int:
        return len(self._optims) + rank

    def _add_buffers(self, model0: dict) -> None:
        module = model0["module"]
        home = self._models[0]
        for name in model0.get("buffer_names") or []:
            ref = module.get(name)
            if not isinstance(ref, TensorRef):
                raise DeepSpeedLayoutError(f"{home.path}: buffer {name!r} missing from 'module'")
            self._add(name, ref.shape, "buffer", [Piece(0, ref.numel, "b", 0)],
                      {"b": (self._model_index(0), ref)}, home)

    def _add_frozen(self, model0: dict) -> None:
        shapes = model0.get("frozen_param_shapes")
        if shapes is None and self.stage <= 2:
            self._add_frozen_from_module(model0)
            return
        shapes = shapes or {}
        for name, shape in shapes.items():
            numel = math.prod(shape)
            refs = {}
            for r, model in enumerate(self._models):  # one file for ZeRO-1/2, one per rank for ZeRO-3
                frags = model.obj.get("frozen_param_fragments") or {}
                ref = frags.get(name)
                if not isinstance(ref, TensorRef):
                    raise DeepSpeedLayoutError(f"{model.path}: frozen parameter {name!r} has no fragment")
                refs[r] = (self._model_index(r), ref)
            try:
                pieces = fragments_layout(numel, [(r, refs[r][1].numel) for r in sorted(refs)])
            except LayoutError as e:
                raise DeepSpeedLayoutError(f"{self._models[0].path}: frozen {name}: {e}") from None
            self._add(name, shape, "frozen", pieces, refs, self._models[0])

    def _add_frozen_from_module(self, model0: dict) -> None:
        """ZeRO-1 checkpoints record no ``frozen_param_shapes`` (zero_to_fp32 then drops
        frozen parameters). Under ZeRO-1/2 the module state dict holds every parameter whole,
        so a frozen one is an entry that is neither trainable, a buffer, nor a tied alias."""
        groups = model0["param_shapes"]
        groups = [groups] if isinstance(groups, dict) else groups
        skip = {n for g in groups for n in g} | set(model0.get("buffer_names") or []) \
            | set(model0.get("shared_params") or {})
        home = self._models[0]
        for name, ref in model0["module"].items():
            if name in skip or not isinstance(ref, TensorRef):
                continue
            self._add(name, ref.shape, "frozen", [Piece(0, ref.numel, "f", 0)],
                      {"f": (self._model_index(0), ref)}, home)

    def _add_trainable(self, model0: dict) -> None:
        groups = model0["param_shapes"]
        if isinstance(groups, dict):
            groups = [groups]
        params = [[(n, math.prod(s)) for n, s in g.items()] for g in groups]
        shapes = {n: s for g in groups for n, s in g.items()}
        key = "single_partition_of_fp32_groups" if self.stage <= 2 else "fp32_flat_groups"
        flats = [_tensor_list(pt, _optimizer_state(pt), key) for pt in self._optims]
        refs = {(r, g): (r, ref) for r, lst in enumerate(flats) for g, ref in enumerate(lst)}
        home = self._optims[0]
        try:
            if self.stage <= 2:
                for pt, lst in zip(self._optims, flats):
                    if len(lst) != len(params):
                        raise DeepSpeedLayoutError(f"{pt.path}: {len(lst)} fp32 partitions but the model "
                                                   f"states list {len(params)} param groups")
                pads = _optimizer_state(home).get("param_alignment_paddings")
                if pads is not None and not any(any(p) for p in pads):
                    pads = None  # all zero: the common case, parameters back to back
                layout = zero12_layout(params, [[ref.numel for ref in lst] for lst in flats], pads)
            else:
                merged = [p for g in params for p in g]
                layout = zero3_layout(merged, [[ref.numel for ref in lst] for lst in flats])
        except LayoutError as e:
            raise DeepSpeedLayoutError(f"{self.tag_dir}: ZeRO-{self.stage} partitions do not match the "
                                       f"parameter shapes: {e}") from None
        for name, pieces in layout.items():
            self._add(name, shapes[name], "param", pieces, refs, home)

    def _forbidden_spans(self) -> list[list[tuple[int, int]]]:
        """Per file, the byte spans of storage records no tensor of ours lives in."""
        out = []
        for pt, used in zip(self._files, self._used_keys):
            spans = sorted((s.offset, s.offset + s.nbytes) for k, s in pt.archive.storage_spans().items()
                           if k not in used and s.nbytes)
            out.append(spans)
        return out

    # -- TensorSource ----------------------------------------------------------------------
    def tensors(self) -> list[TensorInfo]:
        return list(self._infos)

    def aliases(self) -> dict[str, str]:
        return dict(self._aliases)

    def read(self, requests) -> None:
        """Fill every request (``out``: a numpy array or a CPU torch tensor of the tensor's
        dtype), one batch of reads for all."""
        wants = []
        for req in requests:
            stored = self._segments.get(req.name)
            if stored is None:
                raise KeyError(f"no tensor {req.name!r} in {self.tag_dir}")
            segments, itemsize = stored
            wants += segment_wants(segments, req.start, as_byte_view(req.out), itemsize, req.name)
        self._reader.read(wants)

    def describe(self) -> str:
        return (f"DeepSpeed ZeRO-{self.stage} checkpoint {self.tag_dir} (world size {self.world_size}"
                f"{', bf16' if self.bf16 else ''}, deepspeed {self.ds_version})")

    @property
    def reader(self) -> ScatterReader:
        return self._reader

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> "DeepSpeedSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["DeepSpeedSource", "DeepSpeedLayoutError", "CheckpointFileError", "ReadRequest"]
