"""Where each parameter's optimizer state lives in this rank's flat store arrays.

Arrays per rank, each named by a typed key (``ArrayKey``: a ``StateKind`` and a dtype;
names get a ``rank{r}/`` prefix in the store, and a dtype suffix such as ``_bfloat16``
when the state is not fp32):

- ``muon_momentum``: Muon momentum buffers;
- ``adam_exp_avg``, ``adam_exp_avg_sq`` (and ``adam_max_exp_avg_sq`` with amsgrad);
- ``master``: fp32 master weights of low-precision parameters, when asked for.

Parameters are cut into **bundles**: consecutive parameters of one kind (same state dtype,
same sharding) whose local state fits one store bucket on every rank; a parameter larger
than a bucket is a bundle of its own. A bundle is the unit of the step pipeline and of one
all_to_all. Bundles are the same on every rank (built from every rank's row counts), so
the ranks walk them in the same order. AdamW bundles are spread evenly between Muon
bundles so that elementwise work overlaps the exchanges.

Pure arithmetic over shapes and ``offload_engine.dtypes`` entries: no torch, so the
planner lays out a 405B-parameter model in a process that never imports it.

**Packing.** Each array is the bundles' local states back to back, with no gap: a bundle
starts where the previous bundle using that array ends, wherever that falls in a bucket.
So every bucket is full of state (only an array's last bucket is short), and a step moves
``state_bytes()`` = the state itself, not bucket padding. A parameter's local shard is the
contiguous elements ``[starts[array] + offsets[param], + sizes[param])`` of each array of
its bundle.

In all arrays of one bundle the state starts at the same position *inside* a bucket (the
arrays of a bundle have one element size: fp32 state with masters, else the state's dtype),
so bucket ``j`` of a bundle (a **row**) lines up across its arrays and a row's
**segments** (the pieces of parameters inside it) have one offset in every array. Bundles
with the same arrays keep this alignment by construction (all their arrays advance by the
same amount). Where a bundle's arrays disagree (the ``master`` array is shared by Muon and
AdamW bundles, ``muon_momentum`` by fp32 parameters without masters and bf16 ones with), all
its arrays are moved to the next bucket boundary first: padding of less than one bucket per
array, only at such a change of kind (``Layout.padding`` counts it; none without master
weights or mixed amsgrad).

**Shared buckets.** A bundle's first and last buckets may hold the neighbouring bundles'
state too, so a bucket can be used by two (or more) rows of one step. The step keeps such a
bucket acquired from its first use to its last (``step_schedule.Leases``): it is read once
and written once per step, like any other. The store's schedule lists it once, at its first
use in the step's walking direction (``step_order``).

**Short tails.** An array's last bucket is usually shorter than a bucket. When the pinned
pool has room for them beyond the step's working set, ZeroMuon keeps these buckets of the
NVMe-homed arrays acquired for its whole life (``short_tails``, ``pool_budget.kept_tails``;
written by ``flush``/``close``), so every bucket the store evicts and reads is a full one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from .. import dtypes
from ..dtypes import FLOAT32, DType
from ..store.geometry import elems_per_bucket
from ..errors import InputError


class StateKind(enum.Enum):
    """A kind of optimizer state: its array's name stem and torch's state-dict key."""

    MOMENTUM = ("muon_momentum", "momentum_buffer")
    EXP_AVG = ("adam_exp_avg", "exp_avg")
    EXP_AVG_SQ = ("adam_exp_avg_sq", "exp_avg_sq")
    MAX_EXP_AVG_SQ = ("adam_max_exp_avg_sq", "max_exp_avg_sq")
    MASTER = ("master", "master_param")

    def __init__(self, stem: str, state_key: str):
        self.stem = stem
        self.state_key = state_key  # torch's key in an optimizer state dict


@dataclass(frozen=True)
class ArrayKey:
    """One flat state array of a rank: what it holds and in which dtype (master weights are
    always fp32)."""

    kind: StateKind
    dtype: DType

    @property
    def name(self) -> str:
        """The array's name in the store (before the ``rank{r}/`` prefix)."""
        return self.kind.stem if self.dtype == FLOAT32 else f"{self.kind.stem}_{self.dtype.name}"


class ArraySpec(NamedTuple):
    """An array of the layout: its key and its length (elements)."""

    key: ArrayKey
    numel: int

    @property
    def dtype(self) -> DType:
        return self.key.dtype


@dataclass(frozen=True)
class Segment:
    param: int        # ParamInfo.index
    lo: int           # element range in the parameter's local (flat) shard
    hi: int
    offset: int       # first element inside the row's bucket


@dataclass
class Row:
    buckets: dict[str, int]          # array name -> bucket index, in the bundle's array order
    segments: list[Segment]


@dataclass
class Bundle:
    index: int
    kind: str                        # "muon" | "adamw"
    params: list[int]                # ParamInfo.index, in order
    distributed: bool
    state_dtype: DType
    keys: list[ArrayKey]             # the arrays this bundle uses, in acquire order
    local_numel: int                 # this rank's elements of state per array
    offsets: dict[int, int] = field(default_factory=dict)  # param -> offset inside the bundle
    sizes: dict[int, int] = field(default_factory=dict)    # param -> local elements
    starts: dict[str, int] = field(default_factory=dict)   # array name -> first element
    rows: list[Row] = field(default_factory=list)

    @property
    def arrays(self) -> list[str]:
        """The names of the arrays this bundle uses, in acquire order."""
        return [k.name for k in self.keys]

    def key(self, kind: StateKind) -> ArrayKey | None:
        """The array holding ``kind`` of state for this bundle (None: it has none)."""
        return next((k for k in self.keys if k.kind is kind), None)


@dataclass
class Layout:
    bucket_bytes: int
    bundles: list[Bundle]
    arrays: dict[str, ArraySpec]                 # array name -> (key, numel)
    param_bundle: dict[int, int]                 # param -> bundle index
    padding: dict[str, int] = field(default_factory=dict)  # name -> elements that hold no state
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def memo(self, key, make):
        """``make()``, computed once per layout (a layout does not change once built)."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def bundle_of(self, param: int) -> Bundle:
        """The bundle holding parameter ``param``'s state."""
        return self.bundles[self.param_bundle[param]]

    def walk(self, reverse: bool = False) -> list[tuple[Bundle, Row, list[str]]]:
        """(bundle, row, array names in acquire order) in the order a step acquires rows."""
        out = []
        for c in (self.bundles[::-1] if reverse else self.bundles):
            for row in (c.rows[::-1] if reverse else c.rows):
                names = list(row.buckets)
                out.append((c, row, names[::-1] if reverse else names))
        return out

    def step_order(self, reverse: bool = False) -> list[tuple[str, int]]:
        """(array, bucket) in the order of first use in a step walking forward or reversed:
        the store's schedule for that step (each bucket once)."""
        key = ("order", reverse)
        if key not in self._cache:
            seen: dict[tuple[str, int], None] = {}
            for _, row, names in self.walk(reverse):
                for n in names:
                    seen.setdefault((n, row.buckets[n]), None)
            self._cache[key] = list(seen)
        return self._cache[key]

    def uses(self) -> dict[tuple[str, int], int]:
        """(array, bucket) -> rows that use it in one step (more than 1: a shared bucket)."""
        if "uses" not in self._cache:
            uses: dict[tuple[str, int], int] = {}
            for c in self.bundles:
                for row in c.rows:
                    for n, b in row.buckets.items():
                        uses[(n, b)] = uses.get((n, b), 0) + 1
            self._cache["uses"] = uses
        return self._cache["uses"]

    def state_bytes(self) -> int:
        """Bytes of all buckets of all arrays (what one pass over the state moves)."""
        return sum(a.numel * a.dtype.itemsize for a in self.arrays.values())

    def padding_bytes(self) -> int:
        """Bytes of the arrays that hold no state (alignment where a bundle's arrays disagree)."""
        return sum(n * self.arrays[name].dtype.itemsize for name, n in self.padding.items())

    def short_tails(self) -> list[tuple[str, int]]:
        """(array, last bucket) of every array whose last bucket is shorter than a bucket.
        ZeroMuon may keep them acquired for its lifetime (``pool_budget.kept_tails``)."""
        out = []
        for name, a in self.arrays.items():
            be = elems_per_bucket(self.bucket_bytes, a.dtype)
            if a.numel % be:
                out.append((name, a.numel // be))
        return out

    def param_pieces(self, index: int) -> list[tuple[int, Segment]]:
        """(row position in its bundle, segment) for every piece of parameter ``index``."""
        bundle = self.bundle_of(index)
        return [(j, s) for j, row in enumerate(bundle.rows) for s in row.segments if s.param == index]


def array_keys(kind: str, state_dtype: DType, amsgrad: bool, master: bool) -> list[ArrayKey]:
    """The arrays a bundle of ``kind`` ("muon" | "adamw") uses, in acquire order."""
    if kind == "muon":
        kinds = [StateKind.MOMENTUM]
    else:
        kinds = [StateKind.EXP_AVG, StateKind.EXP_AVG_SQ] + ([StateKind.MAX_EXP_AVG_SQ] if amsgrad else [])
    keys = [ArrayKey(k, state_dtype) for k in kinds]
    return keys + ([ArrayKey(StateKind.MASTER, FLOAT32)] if master else [])


def build_layout(infos, rank: int, bucket_bytes: int, master_for, state_dtype_of,
                 amsgrad_of) -> Layout:
    """Bundles and array extents for this rank.

    ``infos``: ParamInfo list; ``master_for(info)``, ``state_dtype_of(info)`` (anything
    ``dtypes.dtype`` takes), ``amsgrad_of(info)`` say what state each parameter has.
    """
    # group by what the state looks like; Muon bundles first (they start communication early)
    keys: dict[tuple, list] = {}
    for info in infos:
        key = (info.kind != "muon", info.kind, dtypes.dtype(state_dtype_of(info)), info.distributed,
               amsgrad_of(info), master_for(info))
        keys.setdefault(key, []).append(info)
    per_kind: dict[str, list[Bundle]] = {"muon": [], "adamw": []}
    for key in sorted(keys, key=lambda k: (k[0], list(keys).index(k))):
        _, kind, dtype, distributed, amsgrad, master = key
        bundles = per_kind[kind]
        if master and dtype != FLOAT32:
            raise InputError("with master weights the optimizer state is fp32")
        cap = elems_per_bucket(bucket_bytes, dtype)
        cur: list = []
        cur_max = None  # per-rank local sums of the open bundle
        for info in keys[key]:
            sizes = [info.local_numel(r) for r in range(info.ranks)]
            if cur:
                trial = [a + b for a, b in zip(cur_max, sizes)]
                if max(trial) <= cap:
                    cur.append(info)
                    cur_max = trial
                    continue
                bundles.append(_bundle(len(bundles), kind, cur, distributed, dtype, amsgrad, master, rank))
            cur, cur_max = [info], sizes
        if cur:
            bundles.append(_bundle(len(bundles), kind, cur, distributed, dtype, amsgrad, master, rank))
    # pack each array: bundles back to back, in bundle order within each kind
    arrays: dict[str, ArraySpec] = {}
    cursors: dict[str, int] = {}
    padding: dict[str, int] = {}
    for c in per_kind["muon"] + per_kind["adamw"]:
        if c.local_numel == 0:   # no rows here: no buckets, an empty range where the cursor is
            c.starts = {n: cursors.get(n, 0) for n in c.arrays}
            continue
        sizes = {k.dtype.itemsize for k in c.keys}
        if len(sizes) != 1:
            raise AssertionError(f"arrays {c.arrays} of one bundle differ in element size")
        be = elems_per_bucket(bucket_bytes, sizes.pop())
        if len({cursors.get(n, 0) % be for n in c.arrays}) > 1:
            # the arrays disagree on the position inside a bucket: start them all on a boundary
            for n in c.arrays:
                cur = cursors.get(n, 0)
                aligned = -(-cur // be) * be
                if aligned != cur:
                    padding[n] = padding.get(n, 0) + aligned - cur
                    cursors[n] = aligned
        for k in c.keys:
            n = k.name
            c.starts[n] = cursors.get(n, 0)
            cursors[n] = c.starts[n] + c.local_numel
            arrays[n] = ArraySpec(k, cursors[n])
        _cut_rows(c, be)
    for c in per_kind["muon"] + per_kind["adamw"]:
        for k in c.keys:  # used only by bundles without rows here: an empty array, not none
            arrays.setdefault(k.name, ArraySpec(k, 0))
    bundles = _interleave(per_kind["muon"], per_kind["adamw"])
    for i, c in enumerate(bundles):
        c.index = i
    return Layout(bucket_bytes, bundles, arrays, {p: c.index for c in bundles for p in c.params},
                  {n: k for n, k in padding.items() if n in arrays})


def _interleave(muon: list[Bundle], adamw: list[Bundle]) -> list[Bundle]:
    """Spread AdamW bundles evenly between Muon bundles: their elementwise work fills the
    time a Muon bundle's exchange is in flight, in either walking direction."""
    pos = [((i + 0.5) / len(muon), 0, i, c) for i, c in enumerate(muon)]
    pos += [((i + 0.5) / len(adamw), 1, i, c) for i, c in enumerate(adamw)]
    return [c for *_, c in sorted(pos, key=lambda t: t[:3])]


def _bundle(index, kind, infos, distributed, dtype, amsgrad, master, rank) -> Bundle:
    c = Bundle(index, kind, [i.index for i in infos], distributed, dtype,
               array_keys(kind, dtype, amsgrad, master), 0)
    r = rank if distributed else 0
    for info in infos:
        c.offsets[info.index] = c.local_numel
        c.sizes[info.index] = info.local_numel(r)
        c.local_numel += info.local_numel(r)
    return c


def _cut_rows(c: Bundle, be: int) -> None:
    """Rows: the buckets the bundle's elements fall in (the same positions in every array)."""
    first = c.arrays[0]
    r = c.starts[first] % be                     # where the bundle starts inside its first bucket
    base = {n: c.starts[n] // be for n in c.arrays}
    nrows = -(-(r + c.local_numel) // be)
    for j in range(nrows):
        c.rows.append(Row({n: base[n] + j for n in c.arrays}, []))
    for p in c.params:
        off, n = r + c.offsets[p], c.sizes[p]
        lo = 0
        while lo < n:
            j = (off + lo) // be
            hi = min(n, (j + 1) * be - off)
            c.rows[j].segments.append(Segment(p, lo, hi, off + lo - j * be))
            lo = hi
