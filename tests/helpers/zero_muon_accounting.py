"""What a ZeroMuon step may move, checked from inside a rank: no collective but all_to_all_single
runs in a step, the store reads and writes each bucket once per step, and the all_to_all
bytes of one step from every rank's box (gathered with torch's own placement arithmetic,
not the optimizer's) and the owners (``expected_bytes``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.zero_muon_harness import set_grads


FORBIDDEN = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
             "reduce_scatter_tensor", "broadcast", "all_gather_object", "gather", "scatter")


def forbid_other_collectives():
    """Make every collective but all_to_all_single raise; returns the originals."""
    saved = {}
    for name in FORBIDDEN:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        saved[name] = fn

        def boom(*a, _n=name, **k):
            raise AssertionError(f"ZeroMuon.step called dist.{_n}")
        setattr(dist, name, boom)
    return saved


def step_only_all_to_all(opt) -> None:
    """``opt.step()`` with every collective but all_to_all_single raising."""
    saved = forbid_other_collectives()
    try:
        opt.step()
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def bucket_sizes(store):
    sizes = {}
    for name, arr in store.arrays().items():
        for i, (a, b) in enumerate(store.bucket_ranges(name)):
            sizes[(name, i)] = (b - a) * arr.itemsize
    return sizes


def check_store_pass(opt, model, ref, rank, world, steps=5):
    """Every bucket written once per step; every bucket not cached at step start read once."""
    store = opt.store
    sizes = bucket_sizes(store)
    total = sum(sizes.values())
    set_grads(model, ref, 0, rank, world)
    opt.step()                      # first step: zero-filled, nothing to read
    store.flush()
    store.stats(reset=True)
    cached_seen = False
    for step in range(1, steps):
        cached = sum(sizes[k] for k in store.resident_buckets())
        cached_seen |= 0 < cached < total
        set_grads(model, ref, step, rank, world)
        opt.step()
        st = opt.last_step_stats
        store.flush()               # write-behind of this step lands in this step's count
        late = store.stats(reset=True)
        read = st.store_bytes_read["nvme"] + late.bytes_read["nvme"]
        written = st.store_bytes_written["nvme"] + late.bytes_written["nvme"]
        assert written == total, (step, written, total)
        assert read == total - cached, (step, read, total, cached)
    assert cached_seen, "the test should cache part of the state, not all or none"


def gathered_boxes(model) -> dict[str, list]:
    """Parameter name -> every rank's box ((offset, end) as torch places it)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    mine = {}
    for n, p in model.named_parameters():
        if isinstance(p, DTensor):
            shape, off = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            mine[n] = (tuple(off), tuple(off[i] + shape[i] for i in range(len(shape))))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {n: [every[r][n] for r in range(len(every))] for n in mine}


def numel(box) -> int:
    lo, hi = box
    return int(torch.tensor([h - l for l, h in zip(lo, hi)]).prod())


def matrix_boxes(info, bx: list, e: int) -> list:
    """Every rank's box of matrix ``e`` of ``info``: the box itself for a 2-D parameter, its
    (rows, cols) part for expert ``e`` of a 3-D stack (empty where the rank holds none)."""
    if len(info.shape) != 3:
        return bx
    return [((lo[1], lo[2]), (hi[1], hi[2])) if lo[0] <= e < hi[0] and numel((lo, hi))
            else ((0, 0), (0, 0)) for lo, hi in bx]


def expected_bytes(opt, boxes: dict[str, list], rank: int) -> tuple[int, int]:
    """(sent, received) bytes of one step of ``rank``, from the boxes and the owners: a rank
    sends its box of U for each matrix whose box it is the source of (the owner if it holds
    that box, else the holder in the owner's replica) and, as an owner, every other holder's
    box of O; it receives the pieces of the matrices it owns and its box of O of every other
    matrix. An expert one rank holds whole and alone moves nothing. bf16: 2 bytes."""
    sent = received = 0
    for info in opt.infos:
        if info.kind != "muon" or info.name not in boxes:
            continue
        stacked = len(info.shape) == 3
        for e in range(info.shape[0] if stacked else 1):
            bx = matrix_boxes(info, boxes[info.name], e)
            full = ((0, 0), tuple(info.shape[-2:]))
            holding = [b for b in bx if numel(b)]
            if stacked and len(holding) == 1 and holding[0] == full:
                continue                                        # kept where it is
            owner = opt.matrix_owner[(info.index, e)]
            k = sum(1 for g in range(owner) if bx[g] == bx[owner])      # the owner's replica index
            holders: dict = {}
            for g, b in enumerate(bx):
                if numel(b):
                    holders.setdefault(b, []).append(g)
            # an owner with an empty box: its replica from its position (ranks replica by replica)
            source = {b: owner if owner in hs else
                      hs[k % len(hs)] if numel(bx[owner]) else hs[owner * len(hs) // len(bx)]
                      for b, hs in holders.items()}
            mine = numel(bx[rank])
            if owner == rank:
                received += sum(numel(b) for b, s in source.items() if s != rank)
                sent += sum(numel(b) for g, b in enumerate(bx) if g != rank)
            else:
                sent += mine if mine and source[bx[rank]] == rank else 0
                received += mine
    return 2 * sent, 2 * received
