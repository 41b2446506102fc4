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

In every array a chunk uses, its state starts at a bucket boundary and is packed the same
way: a parameter's local shard is a contiguous element range at the same offset in each
of the chunk's arrays. A chunk therefore owns whole buckets (read once, written once per
step, never shared with another chunk), and bucket ``j`` of a chunk (a **row**) lines up
across its arrays. A row's **segments** are the pieces of parameters inside it.
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


@dataclass
class Layout:
    bucket_bytes: int
    chunks: list[Chunk]
    arrays: dict[str, tuple[torch.dtype, int]]   # name -> (dtype, numel)
    param_chunk: dict[int, int]                  # param -> chunk index

    def forward_order(self) -> list[tuple[str, int]]:
        """(array, bucket) in the order a forward step touches them."""
        return [(name, b) for c in self.chunks for row in c.rows for name, b in row.buckets.items()]

    def state_bytes(self) -> int:
        """Bytes of all buckets of all arrays (what one pass over the state moves)."""
        total = 0
        for dtype, numel in self.arrays.values():
            total += numel * _itemsize(dtype)
        return total

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
    chunks = _interleave(per_kind["muon"], per_kind["adamw"])
    for i, c in enumerate(chunks):
        c.index = i

    arrays: dict[str, tuple[torch.dtype, int]] = {}
    cursors: dict[str, int] = {}
    for c in chunks:
        for name in c.arrays:
            dtype = torch.float32 if name == MASTER else c.state_dtype
            be = bucket_bytes // _itemsize(dtype)
            if c.local_numel == 0:
                continue
            start = -(-cursors.get(name, 0) // be) * be
            c.starts[name] = start
            cursors[name] = start + c.local_numel
            arrays[name] = (dtype, cursors[name])
        _cut_rows(c, bucket_bytes)
    return Layout(bucket_bytes, chunks, arrays,
                  {p: c.index for c in chunks for p in c.params})


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


def _cut_rows(c: Chunk, bucket_bytes: int) -> None:
    if c.local_numel == 0:
        return
    be = bucket_bytes // _itemsize(c.state_dtype)
    # a master array is fp32; with master weights the state is fp32 too, so rows line up
    nrows = -(-c.local_numel // be)
    for j in range(nrows):
        c.rows.append(Row({name: c.starts[name] // be + j for name in c.arrays}, []))
    for p in c.params:
        off, n = c.offsets[p], c.sizes[p]
        lo = 0
        while lo < n:
            j = (off + lo) // be
            hi = min(n, (j + 1) * be - off)
            c.rows[j].segments.append(Segment(p, lo, hi, off + lo - j * be))
            lo = hi
