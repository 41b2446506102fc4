"""Where each parameter's optimizer state lives in this rank's flat store arrays.

Arrays per rank (names get a ``rank{r}/`` prefix in the store; a dtype suffix such as
``_bfloat16`` when the state is not fp32):

- ``muon_momentum``: Muon momentum buffers;
- ``adam_exp_avg``, ``adam_exp_avg_sq`` (and ``adam_max_exp_avg_sq`` with amsgrad);
- ``master``: fp32 master weights of low-precision parameters, when asked for.

Parameters are cut into **chunks**: consecutive parameters of one kind (same state dtype,
same sharding) whose local state fits one store bucket on every rank; a parameter larger
than a bucket is a chunk of its own. A chunk is the unit of the step pipeline and of one
all_to_all. Chunks are the same on every rank (built from every rank's row counts), so
the ranks walk them in the same order. AdamW chunks are spread evenly between Muon chunks
so that elementwise work overlaps the exchanges.

**Packing.** Each array is the chunks' local states back to back, with no gap: a chunk
starts where the previous chunk using that array ends, wherever that falls in a bucket.
So every bucket is full of state (only an array's last bucket is short), and a step moves
``state_bytes()`` = the state itself, not bucket padding. A parameter's local shard is the
contiguous elements ``[starts[array] + offsets[param], + sizes[param])`` of each array of
its chunk.

In all arrays of one chunk the state starts at the same position *inside* a bucket (the
arrays of a chunk have one element size: fp32 state with masters, else the state's dtype),
so bucket ``j`` of a chunk (a **row**) lines up across its arrays and a row's
**segments** (the pieces of parameters inside it) have one offset in every array. Chunks
with the same arrays keep this alignment by construction (all their arrays advance by the
same amount). Where a chunk's arrays disagree (the ``master`` array is shared by Muon and
AdamW chunks, ``muon_momentum`` by fp32 parameters without masters and bf16 ones with), all
its arrays are moved to the next bucket boundary first: padding of less than one bucket per
array, only at such a change of kind (``Layout.padding`` counts it; none without master
weights or mixed amsgrad).

**Shared buckets.** A chunk's first and last buckets may hold the neighbouring chunks'
state too, so a bucket can be used by two (or more) rows of one step. The step keeps such a
bucket acquired from its first use to its last (``step_events.Leases``): it is read once
and written once per step, like any other. The store's schedule lists it once, at its first
use in the step's walking direction (``step_order``).

**Short tails.** An array's last bucket is usually shorter than a bucket. When the pinned
pool has room for them beyond the step's working set, ZeroMuon keeps these buckets of the
NVMe-homed arrays acquired for its whole life (``short_tails``, ``step_events.kept_tails``;
written by ``flush``/``close``), so every bucket the store evicts and reads is a full one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MOMENTUM, EXP_AVG, EXP_AVG_SQ, MAX_EXP_AVG_SQ, MASTER = (
    "muon_momentum", "adam_exp_avg", "adam_exp_avg_sq", "adam_max_exp_avg_sq", "master")


@dataclass(frozen=True)
class Segment:
    param: int        # ParamInfo.index
    lo: int           # element range in the parameter's local (flat) shard
    hi: int
    offset: int       # first element inside the row's bucket


@dataclass
class Row:
    buckets: dict[str, int]          # array name -> bucket index, in the chunk's array order
    segments: list[Segment]


@dataclass
class Chunk:
    index: int
    kind: str                        # "muon" | "adamw"
    params: list[int]                # ParamInfo.index, in order
    distributed: bool
    state_dtype: torch.dtype
    arrays: list[str]                # arrays this chunk uses (names without the rank prefix)
    local_numel: int                 # this rank's elements of state per array
    offsets: dict[int, int] = field(default_factory=dict)  # param -> offset inside the chunk
    sizes: dict[int, int] = field(default_factory=dict)    # param -> local elements
    starts: dict[str, int] = field(default_factory=dict)   # array -> first element
    rows: list[Row] = field(default_factory=list)

    def array_dtype(self, name: str) -> torch.dtype:
        """The dtype of this chunk's state in array ``name``: fp32 for ``master``, else the
        chunk's state dtype."""
        return torch.float32 if name == MASTER else self.state_dtype


@dataclass
class Layout:
    bucket_bytes: int
    chunks: list[Chunk]
    arrays: dict[str, tuple[torch.dtype, int]]   # name -> (dtype, numel)
    param_chunk: dict[int, int]                  # param -> chunk index
    padding: dict[str, int] = field(default_factory=dict)  # name -> elements that hold no state
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def walk(self, reverse: bool = False) -> list[tuple[Chunk, Row, list[str]]]:
        """(chunk, row, array names in acquire order) in the order a step acquires rows."""
        out = []
        for c in (self.chunks[::-1] if reverse else self.chunks):
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
            for c in self.chunks:
                for row in c.rows:
                    for n, b in row.buckets.items():
                        uses[(n, b)] = uses.get((n, b), 0) + 1
            self._cache["uses"] = uses
        return self._cache["uses"]

    def state_bytes(self) -> int:
        """Bytes of all buckets of all arrays (what one pass over the state moves)."""
        total = 0
        for dtype, numel in self.arrays.values():
            total += numel * _itemsize(dtype)
        return total

    def padding_bytes(self) -> int:
        """Bytes of the arrays that hold no state (alignment where a chunk's arrays disagree)."""
        return sum(n * _itemsize(self.arrays[name][0]) for name, n in self.padding.items())

    def short_tails(self) -> list[tuple[str, int]]:
        """(array, last bucket) of every array whose last bucket is shorter than a bucket.
        ZeroMuon may keep them acquired for its lifetime (``step_events.kept_tails``)."""
        out = []
        for name, (dtype, numel) in self.arrays.items():
            be = self.bucket_bytes // _itemsize(dtype)
            if numel % be:
                out.append((name, numel // be))
        return out

    def param_pieces(self, index: int) -> list[tuple[int, Segment]]:
        """(row position in its chunk, segment) for every piece of parameter ``index``."""
        chunk = self.chunks[self.param_chunk[index]]
        return [(j, s) for j, row in enumerate(chunk.rows) for s in row.segments if s.param == index]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def array_names(kind: str, state_dtype: torch.dtype, amsgrad: bool, master: bool) -> list[str]:
    sfx = "" if state_dtype == torch.float32 else "_" + str(state_dtype).removeprefix("torch.")
    if kind == "muon":
        names = [MOMENTUM + sfx]
    else:
        names = [EXP_AVG + sfx, EXP_AVG_SQ + sfx] + ([MAX_EXP_AVG_SQ + sfx] if amsgrad else [])
    return names + ([MASTER] if master else [])


def build_layout(infos, rank: int, bucket_bytes: int, master_for, state_dtype_of,
                 amsgrad_of) -> Layout:
    """Chunks and array extents for this rank.

    ``infos``: ParamInfo list; ``master_for(info)``, ``state_dtype_of(info)``,
    ``amsgrad_of(info)`` say what state each parameter has.
    """
    # group by what the state looks like; Muon chunks first (they start communication early)
    keys: dict[tuple, list] = {}
    for info in infos:
        key = (info.kind != "muon", info.kind, state_dtype_of(info), info.distributed,
               amsgrad_of(info), master_for(info))
        keys.setdefault(key, []).append(info)
    per_kind: dict[str, list[Chunk]] = {"muon": [], "adamw": []}
    for key in sorted(keys, key=lambda k: (k[0], list(keys).index(k))):
        _, kind, dtype, distributed, amsgrad, master = key
        chunks = per_kind[kind]
        if master and dtype != torch.float32:
            raise ValueError("with master weights the optimizer state is fp32")
        cap = bucket_bytes // _itemsize(dtype)
        cur: list = []
        cur_max = None  # per-rank local sums of the open chunk
        for info in keys[key]:
            sizes = [info.local_numel(r) for r in range(len(info.rows_per_rank))]
            if cur:
                trial = [a + b for a, b in zip(cur_max, sizes)]
                if max(trial) <= cap:
                    cur.append(info)
                    cur_max = trial
                    continue
                chunks.append(_chunk(len(chunks), kind, cur, distributed, dtype, amsgrad, master, rank))
            cur, cur_max = [info], sizes
        if cur:
            chunks.append(_chunk(len(chunks), kind, cur, distributed, dtype, amsgrad, master, rank))
    # pack each array: chunks back to back, in chunk order within each kind
    arrays: dict[str, tuple[torch.dtype, int]] = {}
    cursors: dict[str, int] = {}
    padding: dict[str, int] = {}
    for c in per_kind["muon"] + per_kind["adamw"]:
        if c.local_numel == 0:   # no rows here: no buckets, an empty range where the cursor is
            c.starts = {n: cursors.get(n, 0) for n in c.arrays}
            continue
        sizes = {_itemsize(c.array_dtype(n)) for n in c.arrays}
        if len(sizes) != 1:
            raise AssertionError(f"arrays {c.arrays} of one chunk differ in element size")
        be = bucket_bytes // sizes.pop()
        if len({cursors.get(n, 0) % be for n in c.arrays}) > 1:
            # the arrays disagree on the position inside a bucket: start them all on a boundary
            for n in c.arrays:
                cur = cursors.get(n, 0)
                aligned = -(-cur // be) * be
                if aligned != cur:
                    padding[n] = padding.get(n, 0) + aligned - cur
                    cursors[n] = aligned
        for n in c.arrays:
            c.starts[n] = cursors.get(n, 0)
            cursors[n] = c.starts[n] + c.local_numel
            arrays[n] = (c.array_dtype(n), cursors[n])
        _cut_rows(c, be)
    for c in per_kind["muon"] + per_kind["adamw"]:
        for n in c.arrays:  # used only by chunks without rows here: an empty array, not none
            arrays.setdefault(n, (c.array_dtype(n), 0))
    chunks = _interleave(per_kind["muon"], per_kind["adamw"])
    for i, c in enumerate(chunks):
        c.index = i
    return Layout(bucket_bytes, chunks, arrays, {p: c.index for c in chunks for p in c.params},
                  {n: k for n, k in padding.items() if n in arrays})


def _interleave(muon: list[Chunk], adamw: list[Chunk]) -> list[Chunk]:
    """Spread AdamW chunks evenly between Muon chunks: their elementwise work fills the time
    a Muon chunk's exchange is in flight, in either walking direction."""
    pos = [((i + 0.5) / len(muon), 0, i, c) for i, c in enumerate(muon)]
    pos += [((i + 0.5) / len(adamw), 1, i, c) for i, c in enumerate(adamw)]
    return [c for *_, c in sorted(pos, key=lambda t: t[:3])]


def _chunk(index, kind, infos, distributed, dtype, amsgrad, master, rank) -> Chunk:
    c = Chunk(index, kind, [i.index for i in infos], distributed, dtype,
              array_names(kind, dtype, amsgrad, master), 0)
    r = rank if distributed else 0
    for info in infos:
        c.offsets[info.index] = c.local_numel
        c.sizes[info.index] = info.local_numel(r)
        c.local_numel += info.local_numel(r)
    return c


def _cut_rows(c: Chunk, be: int) -> None:
    """Rows: the buckets the chunk's elements fall in (the same positions in every array)."""
    first = c.arrays[0]
    r = c.starts[first] % be                     # where the chunk starts inside its first bucket
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
