"""Bytes per tier per rank: what ZeroMuon and its TieredStore allocate for a model.

Nothing here allocates a weight. Parameters are described to the optimizer's own code
(``optim.params.ParamInfo``), classified by its own rule (``optim.param_rules.use_muon_for``,
on the name and number of dimensions) and laid out by its own ``build_layout``, so the arrays, their sizes and
their bucket boundaries are exactly those ZeroMuon registers, per rank. Around them:

- sharding: FSDP2 ``Shard(0)``, rank r holds ``torch.chunk`` rows (``ceil(rows/W)`` each,
  the last ranks fewer, possibly none); world size 1 is plain tensors;
- the all_to_all buffers (``SLOTS`` bf16 send and receive buffers sized for the largest
  Muon bundle), the Newton-Schulz workspace (two bf16 buffers of the largest owned matrix,
  two of its smaller dimension squared), the optimizer's scratch (one buffer of the
  longest segment per use), with owners from ``optim.owners.assign_owners``;
- the store: pinned pool = ``cpu_budget`` (page-rounded), chunk files on NVMe at full
  chunk size (edge chunk padded), one ``zarr.json`` per array and one per store.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field

from .. import dtypes
from ..dtypes import BFLOAT16, FLOAT32, DType
from ..layout.flat_array import chunk_bytes_for
from ..layout.group import group_doc
from ..layout.manifest import SHARDS, fsdp_rows
from ..layout.store_group import store_array_entry, store_group_attributes
from ..layout.metadata import compact_json, new_array_doc
from ..optim.muon_defaults import DEFAULT_NS_STEPS
from ..optim.owners import assign_owners, ns_flops
from ..optim.param_rules import is_expert_stack, use_muon_for
from ..optim.params import ParamInfo
from ..optim.state_layout import ArrayKey, StateKind, build_layout
from ..optim.step_schedule import SLOTS
from ..optim.store_manifest import manifest_tables
from ..store.config import default as store_default
from ..store.geometry import array_pool_bytes, bucket_sizes, elems_per_bucket
from ..units import MiB
from . import model_limits
from .model_shapes import ModelInputError, ModelShapes, unit_name

BF16 = BFLOAT16.itemsize  # bytes of an exchanged element


@dataclass(frozen=True)
class PlanOptions:
    """What the run looks like. Sizes in bytes."""

    world_size: int
    gpus_per_node: int = 8
    param_dtype: DType = BFLOAT16
    master_weights: bool = False          # fp32 masters (and fp32 state) in the store
    bucket_bytes: int = store_default("bucket_bytes")
    prefetch_depth: int = store_default("prefetch_depth")
    device: str = "cuda"                  # where parameters (and the optimizer) live: cuda|cpu
    gpu: bool = True                      # a GPU computes (FSDP2 gathers units onto it)
    amsgrad: bool = False
    ns_steps: int = DEFAULT_NS_STEPS
    expert_parallel: int = 1              # ep ranks an MoE block's experts are spread over

    def __post_init__(self):
        # any spelling dtypes.dtype takes (a torch dtype from a test, "bf16" from the CLI)
        object.__setattr__(self, "param_dtype", dtypes.dtype(self.param_dtype))

    @property
    def ranks_per_node(self) -> int:
        return min(self.gpus_per_node, self.world_size)

    @property
    def nodes(self) -> int:
        return -(-self.world_size // self.ranks_per_node)


# ----------------------------------------------------------------------------------------------
# classification and sharding
# ----------------------------------------------------------------------------------------------
def classify(model: ModelShapes) -> list[str]:
    """"muon" or "adamw" per tensor, by the optimizer's own default rule."""
    return ["muon" if use_muon_for(t.name, len(t.shape)) else "adamw" for t in model.tensors]


def rank_groups(row_counts, world: int) -> list[int]:
    """The first rank of each run of ranks that hold the same rows of every parameter
    (at most two boundaries per parameter: where full blocks end and after a short one)."""
    starts = {0}
    for rows in row_counts:
        if rows and world > 1:
            per = -(-rows // world)
            full, rem = divmod(rows, per)
            starts.update(b for b in (full, full + 1 if rem else 0) if 0 < b < world)
    return sorted(starts)


def param_infos(model: ModelShapes, opts: PlanOptions, kinds: list[str] | None = None,
                ranks: list[int] | None = None) -> list[ParamInfo]:
    """ParamInfos in ZeroMuon's order (its groups: Muon parameters, then AdamW ones).

    ``rows_per_rank[j]`` holds the rows of rank ``ranks[j]`` (default: every rank). Giving one
    rank per group of identical ranks lays out the same bundles: ``build_layout`` only takes
    maxima over ranks.
    """
    kinds = kinds or classify(model)
    world = opts.world_size
    ranks = list(range(world)) if ranks is None else ranks
    group = {"amsgrad": opts.amsgrad, "ns_steps": opts.ns_steps, "nesterov": True}
    infos = []
    for kind in ("muon", "adamw"):
        for t, k in zip(model.tensors, kinds):
            if k != kind:
                continue
            info = ParamInfo(len(infos), None, group, t.name, kind, tuple(t.shape),
                             opts.param_dtype, world > 1)
            info.rows_per_rank = ([fsdp_rows(info.rows, world)[r] for r in ranks]
                                  if world > 1 else [info.rows])
            infos.append(info)
    return infos


# ----------------------------------------------------------------------------------------------
# one rank's state arrays
# ----------------------------------------------------------------------------------------------
@dataclass
class ArrayPlan:
    """One flat store array of one rank."""

    key: ArrayKey         # what it holds, in which dtype (ZeroMuon's layout's key)
    numel: int
    bucket_bytes: int     # the store's bucket_bytes
    home: str = "nvme"

    @property
    def name(self) -> str:
        """Without the rank prefix, as ZeroMuon's layout names it."""
        return self.key.name

    @property
    def dtype(self) -> DType:
        return self.key.dtype

    @property
    def itemsize(self) -> int:
        return self.key.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def bucket_elems(self) -> int:
        return elems_per_bucket(self.bucket_bytes, self.dtype)

    def buckets(self) -> list[int]:
        """Bytes of each bucket (the last one shorter)."""
        return bucket_sizes(self.numel, self.dtype, self.bucket_bytes)

    @property
    def pinned_bytes(self) -> int:
        """Pool bytes the whole array takes when resident (each bucket page-rounded)."""
        return array_pool_bytes(self.numel, self.dtype, self.bucket_bytes)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of each chunk file, as FlatArray sizes them for the store's buckets."""
        return chunk_bytes_for(self.numel, self.itemsize, self.bucket_bytes)

    @property
    def nchunks(self) -> int:
        ce = self.chunk_bytes // self.itemsize
        return -(-self.numel // ce) if self.numel else 0

    @property
    def file_bytes(self) -> int:
        """Bytes of its chunk files once every bucket was written (edge chunk full size)."""
        return self.nchunks * self.chunk_bytes

    def metadata_bytes(self) -> int:
        """Size of the array's zarr.json as FlatArray writes it."""
        doc = new_array_doc(self.numel, self.dtype, self.chunk_bytes // self.itemsize,
                            {"offload_engine": {"home": "nvme"}}, "element")
        return len(json.dumps(doc, indent=2, allow_nan=False)) + 1

    @property
    def kind(self) -> str:
        """"momentum", "exp_avg", "exp_avg_sq", "max_exp_avg_sq" or "master"."""
        return self.key.kind.name.lower()


@dataclass
class RankState:
    """What one rank holds: its layout, arrays, shards and buffers (elements)."""

    rank: int
    layout: object                       # optim.state_layout.Layout
    arrays: dict[str, ArrayPlan]
    local_numel: int                     # parameter elements this rank holds
    local_muon: int
    local_adamw: int
    send_max: int = 0                    # all_to_all buffer elements (bf16)
    recv_max: int = 0
    a2a_sent: int = 0                    # bytes per step to other ranks
    a2a_received: int = 0
    a2a_calls: int = 0
    ns_max_numel: int = 0
    ns_max_min_dim: int = 0
    ns_flops: int = 0                    # Newton-Schulz multiply-adds per step
    max_segment: int = 0
    infos: list = field(default_factory=list, repr=False)  # this rank's view (its layout's)


def rank_layout(infos: list[ParamInfo], rank: int, opts: PlanOptions):
    master_for = lambda i: opts.master_weights and dtypes.dtype(i.dtype) != FLOAT32
    return build_layout(infos, rank, opts.bucket_bytes, master_for=master_for,
                        state_dtype_of=lambda i: FLOAT32 if master_for(i) else i.dtype,
                        amsgrad_of=lambda i: i.kind == "adamw" and opts.amsgrad)


def check_bucket_count(model: ModelShapes, bucket_bytes: int) -> None:
    """Refuse a model whose fp32 state array (4 bytes an element) would take more than
    ``MAX_PLAN_BUCKETS`` buckets of ``bucket_bytes``: the layout builds an object per bucket,
    so this bounds the planner's memory before it starts."""
    buckets = -(-model.numel * 4 // max(1, bucket_bytes))
    if buckets > model_limits.MAX_PLAN_BUCKETS:
        raise ModelInputError(
            f"{model.source}: {model.numel} parameters make {buckets} buckets of {bucket_bytes} "
            f"bytes per state array; the planner lays out at most {model_limits.MAX_PLAN_BUCKETS} "
            f"(a bigger --bucket-bytes plans a bigger model)")


@dataclass(frozen=True)
class PlannedMatrix:
    """One Muon matrix as ZeroMuon's owners see it (``optim.matrices.Matrix``, without the
    per-rank boxes: the planner's FSDP2 row split gives them)."""

    shape: tuple[int, int]
    candidates: list[int] | None     # an expert: its one holder; a 2-D parameter: any rank

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def kept(self) -> bool:
        return self.candidates is not None


def bundle_matrices(infos: list[ParamInfo], world: int) -> list[PlannedMatrix]:
    """The matrices of one exchanged bundle in ZeroMuon's order (``comm.plan_matrices``): a
    2-D parameter is one, exchanged; a stack of E experts is E, and FSDP2's ``Shard(0)`` on
    the expert dimension gives each expert whole to one rank (``fsdp_rows(E, world)``
    experts per rank, in rank order), which keeps it: no exchange."""
    out = []
    for i in infos:
        if not i.stacked:
            out.append(PlannedMatrix((i.rows, i.row_numel), None))
            continue
        holder = [r for r, n in enumerate(fsdp_rows(i.shape[0], world)) for _ in range(n)]
        out += [PlannedMatrix(i.matrix_shape, [holder[e]]) for e in range(i.matrices)]
    return out


def rank_states(model: ModelShapes, opts: PlanOptions, kinds: list[str] | None = None) -> list[RankState]:
    """One RankState per rank. Ranks holding the same rows share one layout (computed with
    ZeroMuon's ``build_layout``); owners, and so the buffers and all_to_all bytes that
    depend on them, are per rank."""
    check_bucket_count(model, opts.bucket_bytes)
    world = opts.world_size
    kinds = kinds or classify(model)
    starts = rank_groups((t.shape[0] if t.shape else 1 for t in model.tensors), world)
    infos = param_infos(model, opts, kinds, ranks=starts)    # index j <-> rank starts[j]
    groups = []
    for j, start in enumerate(starts):
        gi = j if world > 1 else 0
        layout = rank_layout(infos, gi, opts)
        arrays = {n: ArrayPlan(a.key, a.numel, opts.bucket_bytes) for n, a in layout.arrays.items()}
        g = {"layout": layout, "arrays": arrays,
             "n": [sum(i.local_numel(gi) for i in infos if kind in (None, i.kind))
                   for kind in (None, "muon", "adamw")],
             "max_segment": max((s.hi - s.lo for c in layout.bundles for row in c.rows
                                 for s in row.segments), default=0),
             "send_max": 0, "dist_local": 0}
        for c in layout.bundles:
            if c.kind != "muon":
                continue
            ps = [infos[p] for p in c.params]
            if c.distributed and world > 1:
                local = sum(i.local_numel(gi) for i in ps)
                g["dist_local"] += local
            else:
                local = sum(i.numel for i in ps)
            g["send_max"] = max(g["send_max"], local)
        groups.append(g)

    # owners: chosen once from shapes, the same on every rank (ZeroMuon's call, with its
    # matrices: one per 2-D parameter, one per expert of a stack, an expert only to its holder)
    probe = groups[0]["layout"]
    exchanged = [c for c in probe.bundles if c.kind == "muon" and c.distributed and world > 1]
    mats = [bundle_matrices([infos[p] for p in c.params], world) for c in exchanged]
    owners = assign_owners([[m.shape for m in ms] for ms in mats], world, opts.ns_steps,
                           candidates=[[m.candidates for m in ms] for ms in mats])
    own_local = [0] * world      # elements of its own matrices a rank holds itself
    own_numel = [0] * world      # elements of the matrices it orthogonalizes
    recv_max = [0] * world
    ns_numel = [0] * world
    ns_dim = [0] * world
    ns_work = [0] * world        # Newton-Schulz FLOPs per step
    calls = 0                    # all_to_all calls per step, the same on every rank (collective;
    #                              a bundle of kept experts only makes none)
    for ms, os_ in zip(mats, owners):
        per_bundle: dict[int, int] = {}
        for m, o in zip(ms, os_):
            rows, cols = m.shape
            if m.kept:           # an expert its one holder orthogonalizes in place
                own_local[o] += m.numel
            else:
                own_local[o] += fsdp_rows(rows, world)[o] * cols
                per_bundle[o] = per_bundle.get(o, 0) + m.numel
            own_numel[o] += m.numel
            ns_numel[o] = max(ns_numel[o], m.numel)
            ns_dim[o] = max(ns_dim[o], min(rows, cols))
            ns_work[o] += ns_flops(rows, cols, opts.ns_steps)
        for o, n in per_bundle.items():
            recv_max[o] = max(recv_max[o], n)
        if per_bundle:
            calls += 2           # U out, O back
    local_muon = [i.matrix_shape for c in probe.bundles if c.kind == "muon"
                  and not (c.distributed and world > 1) for i in (infos[p] for p in c.params)
                  for _ in range(i.matrices)]

    out = []
    for r in range(world):
        g = groups[bisect.bisect_right(starts, r) - 1]
        st = RankState(r, g["layout"], g["arrays"], local_numel=g["n"][0], local_muon=g["n"][1],
                       local_adamw=g["n"][2], send_max=g["send_max"], max_segment=g["max_segment"],
                       infos=infos)
        if exchanged:
            st.recv_max = recv_max[r]
            # U to the owners and O back, bf16, a rank's own block excluded
            moved = (g["dist_local"] - own_local[r]) + (own_numel[r] - own_local[r])
            st.a2a_sent = st.a2a_received = BF16 * moved
            st.a2a_calls = calls
            st.ns_max_numel, st.ns_max_min_dim = ns_numel[r], ns_dim[r]
            st.ns_flops = ns_work[r]
        if local_muon:
            st.ns_max_numel = max([st.ns_max_numel] + [a * b for a, b in local_muon])
            st.ns_max_min_dim = max([st.ns_max_min_dim] + [min(a, b) for a, b in local_muon])
            st.ns_flops += sum(ns_flops(a, b, opts.ns_steps) for a, b in local_muon)
        out.append(st)
    return out


# ----------------------------------------------------------------------------------------------
# bytes on the compute device
# ----------------------------------------------------------------------------------------------
def gathered_unit(model: ModelShapes, expert_parallel: int = 1) -> int:
    """Elements of the largest FSDP2 unit as gathered: each layer block (or the root), its
    expert stacks counted ``1/expert_parallel`` (FSDP2 gathers them only over the
    expert-data-parallel group: the ep rank's own experts, ``ceil(E / ep)`` of E)."""
    if expert_parallel <= 1 or model.moe is None:
        return max(model.units().values(), default=0)
    per: dict[str, int] = {}
    for t in model.tensors:
        unit, n = unit_name(t.name), t.numel
        if is_expert_stack(t.name, len(t.shape)):
            n = n // t.shape[0] * -(-t.shape[0] // expert_parallel)
        per[unit] = per.get(unit, 0) + n
    return max(per.values(), default=0)


def compute_bytes(st: RankState, model: ModelShapes, opts: PlanOptions, gpu_budget: int,
                  activations: int = 0) -> tuple[dict[str, int], dict[str, int]]:
    """(GPU bytes, host bytes) of rank ``st.rank`` besides the store's pinned pool.

    Parameters, gradients and the optimizer's buffers sit on ``opts.device`` (the GPU, or
    host memory with FSDP2's CPUOffloadPolicy / a CPU-only run); the gathered FSDP2 unit and
    activations sit on the GPU when there is one; the store's staging arena on the GPU when
    the optimizer runs there.
    """
    p = opts.param_dtype.itemsize
    unit = gathered_unit(model, min(opts.expert_parallel, opts.world_size))
    seg = max(st.max_segment, 1)
    master = opts.master_weights and opts.param_dtype != FLOAT32
    scratch = 0
    if any(a.kind == "momentum" for a in st.arrays.values()):
        mom = next(a.dtype for a in st.arrays.values() if a.kind == "momentum")
        scratch += seg * mom.itemsize                        # "u": the Nesterov input
    if any(a.kind == "exp_avg" for a in st.arrays.values()):
        scratch += seg * (4 if master else p)                # "denom"
    if master and st.arrays:
        scratch += seg * 4                                   # "grad" cast to fp32
    on_device = {
        "params": st.local_numel * p,
        "grads": st.local_numel * p,
        "all_to_all_buffers": SLOTS * (max(st.send_max, 1) + max(st.recv_max, 1)) * BF16,
        "newton_schulz_workspace": (2 * max(st.ns_max_numel, 1) + 2 * max(st.ns_max_min_dim ** 2, 1)) * BF16,
        "optimizer_scratch": scratch,
    }
    gpu: dict[str, int] = {}
    host: dict[str, int] = {}
    (gpu if opts.device == "cuda" else host).update(on_device)
    if opts.gpu:
        sharded = opts.world_size > 1 or opts.device != "cuda"
        gpu["fsdp_unsharded_unit"] = 2 * unit * p if sharded else 0
        gpu["activations"] = activations
    if opts.device == "cuda":
        gpu["store_gpu_arena"] = gpu_budget
    return gpu, host


def store_metadata_bytes(arrays: list[ArrayPlan], stripes: list[str],
                         tables: tuple[dict, dict]) -> int:
    """Bytes of a rank's store metadata besides its arrays' zarr.json: the group's zarr.json
    (the manifest as TieredStore writes it, compact, with ZeroMuon's tensor table and shard
    table from ``tables`` = ``rank_tables(...)`` merged into it)."""
    root, shards = tables
    attrs = store_group_attributes(
        {a.name: store_array_entry(a.dtype.name, a.numel, "nvme", a.bucket_elems)
         for a in arrays}, stripes, {**root, SHARDS: shards, "step": 0})
    return len(compact_json(group_doc(attrs))) + 1


def rank_tables(st: RankState, world: int) -> tuple[dict, dict]:
    """ZeroMuon's manifest tables for rank ``st.rank`` (``optim.store_manifest``): every
    parameter is FSDP2-sharded when ``world`` > 1."""
    return manifest_tables(st.infos, st.layout, st.rank, world, lambda n: n,
                           lambda i: fsdp_rows(i.rows, world))
