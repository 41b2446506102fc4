"""Bytes per tier per rank: what ZeroMuon and its TieredStore allocate for a model.

Nothing here allocates a weight. Parameters are described to the optimizer's own code
(``optim.sharding.ParamInfo``), classified by its own rule (``default_use_muon``, called
on a meta tensor) and laid out by its own ``build_layout``, so the arrays, their sizes and
their bucket boundaries are exactly those ZeroMuon registers, per rank. Around them:

- sharding: FSDP2 ``Shard(0)``, rank r holds ``torch.chunk`` rows (``ceil(rows/W)`` each,
  the last ranks fewer, possibly none); world size 1 is plain tensors;
- the all_to_all buffers (``SLOTS`` bf16 send and receive buffers sized for the largest
  Muon chunk), the Newton-Schulz workspace (two bf16 buffers of the largest owned matrix,
  two of its smaller dimension squared), the optimizer's scratch (one buffer of the
  longest segment per use), with owners from ``optim.owners.assign_owners``;
- the store: pinned pool = ``cpu_budget`` (page-rounded), chunk files on NVMe at full
  chunk size (edge chunk padded), one ``zarr.json`` per array and one per store.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from ..io.align import round_up
from ..layout import dtypes as zdtypes
from ..layout.metadata import new_array_doc
from ..optim.owners import assign_owners
from ..optim.param_rules import default_use_muon
from ..optim.pipeline import SLOTS
from ..optim.sharding import ParamInfo
from ..optim.state_layout import EXP_AVG, EXP_AVG_SQ, MASTER, MAX_EXP_AVG_SQ, MOMENTUM, build_layout
from .model_shapes import ModelShapes

MiB = 1 << 20
BF16 = 2
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}


_ITEMSIZE: dict = {}


def itemsize(dtype: torch.dtype) -> int:
    if dtype not in _ITEMSIZE:
        _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return _ITEMSIZE[dtype]


@dataclass(frozen=True)
class PlanOptions:
    """What the run looks like. Sizes in bytes."""

    world_size: int
    gpus_per_node: int = 8
    param_dtype: torch.dtype = torch.bfloat16
    master_weights: bool = False          # fp32 masters (and fp32 state) in the store
    bucket_bytes: int = 64 * MiB
    prefetch_depth: int = 2
    device: str = "cuda"                  # where parameters (and the optimizer) live: cuda|cpu
    gpu: bool = True                      # a GPU computes (FSDP2 gathers units onto it)
    amsgrad: bool = False
    ns_steps: int = 5

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
    return ["muon" if default_use_muon(t.name, torch.empty(t.shape, device="meta")) else "adamw"
            for t in model.tensors]


def shard_rows(rows: int, world: int) -> list[int]:
    """Rows per rank under FSDP2 ``Shard(0)`` (torch.chunk sizes, the last ranks short or 0)."""
    per = -(-rows // world) if rows else 0
    return [max(0, min(per, rows - r * per)) for r in range(world)]


def param_infos(model: ModelShapes, opts: PlanOptions, kinds: list[str] | None = None) -> list[ParamInfo]:
    """ParamInfos in ZeroMuon's order (its groups: Muon parameters, then AdamW ones)."""
    kinds = kinds or classify(model)
    world = opts.world_size
    group = {"amsgrad": opts.amsgrad, "ns_steps": opts.ns_steps, "nesterov": True}
    infos = []
    for kind in ("muon", "adamw"):
        for t, k in zip(model.tensors, kinds):
            if k != kind:
                continue
            info = ParamInfo(len(infos), None, group, t.name, kind, tuple(t.shape),
                             opts.param_dtype, world > 1)
            row_numel = 1
            for d in t.shape[1:]:
                row_numel *= d
            info.row_numel = row_numel
            info.rows_per_rank = shard_rows(info.rows, world) if world > 1 else [info.rows]
            infos.append(info)
    return infos


# ----------------------------------------------------------------------------------------------
# one rank's state arrays
# ----------------------------------------------------------------------------------------------
@dataclass
class ArrayPlan:
    """One flat store array of one rank."""

    name: str             # without the rank prefix, as ZeroMuon's layout names it
    dtype: torch.dtype
    numel: int
    bucket_bytes: int     # the store's bucket_bytes
    home: str = "nvme"

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def bucket_elems(self) -> int:
        return self.bucket_bytes // self.itemsize

    def buckets(self) -> list[int]:
        """Bytes of each bucket (the last one shorter)."""
        be, n, size = self.bucket_elems, self.numel, self.itemsize
        return [(min(s + be, n) - s) * size for s in range(0, n, be)]

    @property
    def pinned_bytes(self) -> int:
        """Pool bytes the whole array takes when resident (each bucket page-rounded)."""
        full, rem = divmod(self.nbytes, self.bucket_elems * self.itemsize)
        return full * round_up(self.bucket_elems * self.itemsize) + (round_up(rem) if rem else 0)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of each chunk file (FlatArray caps it at the page-rounded array size)."""
        return min(self.bucket_bytes, round_up(max(self.nbytes, 1)))

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
        element = zdtypes.from_torch(self.dtype)
        doc = new_array_doc(self.numel, element, self.chunk_bytes // self.itemsize,
                            {"offload_engine": {"home": "nvme"}}, "element")
        return len(json.dumps(doc, indent=2, allow_nan=False)) + 1

    @property
    def kind(self) -> str:
        for prefix, kind in ((MOMENTUM, "momentum"), (EXP_AVG_SQ, "exp_avg_sq"),
                             (MAX_EXP_AVG_SQ, "max_exp_avg_sq"), (EXP_AVG, "exp_avg"),
                             (MASTER, "master")):
            if self.name.startswith(prefix):
                return kind
        return self.name


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
    ns_owned: int = 0
    max_segment: int = 0

    def order(self) -> list[tuple[str, int]]:
        """(array, bucket) in the order a forward step acquires them."""
        return self.layout.forward_order()


def rank_layout(infos: list[ParamInfo], rank: int, opts: PlanOptions):
    master_for = lambda i: opts.master_weights and i.dtype != torch.float32
    return build_layout(infos, rank, opts.bucket_bytes, master_for=master_for,
                        state_dtype_of=lambda i: torch.float32 if master_for(i) else i.dtype,
                        amsgrad_of=lambda i: i.kind == "adamw" and opts.amsgrad)


def rank_states(model: ModelShapes, opts: PlanOptions, ranks=None,
                kinds: list[str] | None = None) -> list[RankState]:
    """One RankState per rank in ``ranks`` (default: all). Ranks holding the same rows share
    one layout computation; owners (and so buffers and traffic) are computed per rank."""
    world = opts.world_size
    infos = param_infos(model, opts, kinds)
    ranks = range(world) if ranks is None else ranks
    layouts: dict[tuple, object] = {}
    probe = rank_layout(infos, 0, opts)
    # owners: chosen once from shapes, the same on every rank (ZeroMuon's call)
    dist_chunks = [c for c in probe.chunks if c.kind == "muon" and c.distributed and world > 1]
    owners = assign_owners([[infos[p].shape for p in c.params] for c in dist_chunks], world,
                           opts.ns_steps)
    owner_of = {c.index: o for c, o in zip(dist_chunks, owners)}
    out = []
    for r in ranks:
        sig = tuple(i.rows_per_rank[r] if i.distributed else -1 for i in infos)
        if sig not in layouts:
            layout = probe if r == 0 else rank_layout(infos, r, opts)
            lr = r if world > 1 else 0
            counts = (sum(i.local_numel(lr) for i in infos),
                      sum(i.local_numel(lr) for i in infos if i.kind == "muon"),
                      sum(i.local_numel(lr) for i in infos if i.kind == "adamw"))
            layouts[sig] = (layout, counts)
        layout, (n_all, n_muon, n_adamw) = layouts[sig]
        arrays = {n: ArrayPlan(n, dt, k, opts.bucket_bytes) for n, (dt, k) in layout.arrays.items()}
        st = RankState(r, layout, arrays, local_numel=n_all, local_muon=n_muon, local_adamw=n_adamw)
        _buffers(st, layout, infos, owner_of, r, world)
        out.append(st)
    return out


def _buffers(st: RankState, layout, infos, owner_of, rank: int, world: int) -> None:
    """Exchange buffers, Newton-Schulz workspace, scratch and all_to_all bytes of one rank,
    as ZeroMuon sizes them (plan_chunk's splits, without building the index maps)."""
    owned_shapes = []
    for c in layout.chunks:
        st.max_segment = max([st.max_segment] + [s.hi - s.lo for row in c.rows for s in row.segments])
        if c.kind != "muon":
            continue
        ps = [infos[p] for p in c.params]
        if not c.distributed or world == 1:
            send = sum(i.numel for i in ps)
            st.send_max = max(st.send_max, send)
            owned_shapes += [(i.rows, i.row_numel) for i in ps]
            continue
        own = owner_of[c.index]
        send = sum(i.local_numel(rank) for i in ps)
        send_self = sum(i.local_numel(rank) for i, o in zip(ps, own) if o == rank)
        mine = [i for i, o in zip(ps, own) if o == rank]
        recv = sum(i.numel for i in mine)
        recv_self = sum(i.local_numel(rank) for i in mine)
        owned_shapes += [(i.rows, i.row_numel) for i in mine]
        st.send_max = max(st.send_max, send)
        st.recv_max = max(st.recv_max, recv)
        # forward sends U to owners, backward returns O: each direction twice, bf16
        st.a2a_sent += BF16 * ((send - send_self) + (recv - recv_self))
        st.a2a_received += BF16 * ((recv - recv_self) + (send - send_self))
        st.a2a_calls += 2
    st.ns_owned = len(owned_shapes)
    st.ns_max_numel = max((r * c for r, c in owned_shapes), default=0)
    st.ns_max_min_dim = max((min(r, c) for r, c in owned_shapes), default=0)


# ----------------------------------------------------------------------------------------------
# bytes on the compute device
# ----------------------------------------------------------------------------------------------
def compute_bytes(st: RankState, model: ModelShapes, opts: PlanOptions, gpu_budget: int,
                  activations: int = 0) -> tuple[dict[str, int], dict[str, int]]:
    """(GPU bytes, host bytes) of rank ``st.rank`` besides the store's pinned pool.

    Parameters, gradients and the optimizer's buffers sit on ``opts.device`` (the GPU, or
    host memory with FSDP2's CPUOffloadPolicy / a CPU-only run); the gathered FSDP2 unit and
    activations sit on the GPU when there is one; the store's staging arena on the GPU when
    the optimizer runs there.
    """
    p = itemsize(opts.param_dtype)
    unit = max(model.units().values(), default=0)
    seg = max(st.max_segment, 1)
    master = opts.master_weights and opts.param_dtype != torch.float32
    scratch = 0
    if any(a.kind == "momentum" for a in st.arrays.values()):
        mom = next(a.dtype for a in st.arrays.values() if a.kind == "momentum")
        scratch += seg * itemsize(mom)                       # "u": the Nesterov input
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


def store_metadata_bytes(arrays: list[ArrayPlan], stripes: list[str]) -> int:
    """Bytes of the store's group zarr.json (the manifest as TieredStore writes it)."""
    doc = {"zarr_format": 3, "node_type": "group", "attributes": {
        "format": "offload-engine-store", "format_version": 1,
        "arrays": {f"rank0/{a.name}": {"dtype": zdtypes.from_torch(a.dtype).zarr_name,
                                       "numel": a.numel, "home": "nvme",
                                       "bucket_elems": a.bucket_elems} for a in arrays},
        "stripes": stripes}}
    return len(json.dumps(doc, indent=2, allow_nan=False)) + 1
