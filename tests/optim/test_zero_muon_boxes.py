"""The box exchange in one process: every rank's plan for one bundle, with the all_to_alls
played out on tensors. Each owner must rebuild its matrices exactly from the pieces it
receives (every element once), and every holder of a box, replicas included, must get its
box of O back where its plan reads it. Splits: FSDP2 rows, HSDP, FSDP + tensor parallel
(strided rows, rectangles), replicated, and all of them in one bundle."""

from __future__ import annotations

import pytest
import torch

from offload_engine.optim.boxes import Box, check_tiling, row_counts, sources
from offload_engine.optim.comm import plan_exchange
from offload_engine.optim.owners import assign_owners
from offload_engine.optim.params import ParamInfo


def chunks(n: int, parts: int) -> list[tuple[int, int]]:
    """torch.chunk's ranges of ``n`` over ``parts`` (the last ones short or empty)."""
    per = -(-n // parts) if n else 0
    return [(min(n, i * per), min(n, (i + 1) * per)) for i in range(parts)]


def rows_split(shape, world):
    return [Box((a, 0), (b, shape[1])) for a, b in chunks(shape[0], world)]


def hsdp_split(shape, replicas, shards):
    """(Replicate(), Shard(0)) on a replicas x shards mesh, ranks row-major."""
    return [b for _ in range(replicas) for b in rows_split(shape, shards)]


def colwise_split(shape, dp, tp):
    """(_StridedShard(0), Shard(0)) on dp x tp: tp takes row chunks, dp chunks those."""
    out = [None] * (dp * tp)
    for t, (a, b) in enumerate(chunks(shape[0], tp)):
        for d, (c, e) in enumerate(chunks(b - a, dp)):
            out[d * tp + t] = Box((a + c, 0), (a + e, shape[1]))
    return out


def rowwise_split(shape, dp, tp):
    """(Shard(0), Shard(1)) on dp x tp: rows over dp, columns over tp."""
    return [Box((a, c), (b, e)) for a, b in chunks(shape[0], dp) for c, e in chunks(shape[1], tp)]


def replicated(shape, world):
    return [Box((0, 0), tuple(shape))] * world


def info_of(index, shape, boxes):
    info = ParamInfo(index, None, {}, f"w{index}", "muon", tuple(shape), "float32", True)
    rows = row_counts(shape, boxes)
    if rows is None:
        info.boxes = boxes
    else:
        info.rows_per_rank = rows
    return info


def play(infos, world, owners=None):
    """Run the two all_to_alls of one bundle on every rank's plan; check what arrives."""
    owners = owners or assign_owners([[i.shape for i in infos]], world)[0]
    plans = [plan_exchange(infos, owners, r, world, True) for r in range(world)]
    g = torch.Generator().manual_seed(0)
    full = {i.index: torch.randn(i.shape, generator=g) for i in infos}
    # way out: each rank packs the boxes it is the source of
    send = []
    for r, pl in enumerate(plans):
        buf = torch.full((pl.send_numel,), float("nan"))
        for i in infos:
            if i.index in pl.send_offset:
                b = i.box(r)
                buf[pl.send_offset[i.index]:][:b.numel] = full[i.index][b.slices()].reshape(-1)
        send.append(buf)
    recv = alltoall(send, [pl.send_splits for pl in plans], [pl.recv_splits for pl in plans])
    # owners rebuild each matrix (every element exactly once) and write O = 2U + 1 back
    out = {i.index: 2 * full[i.index] + 1 for i in infos}
    back_send = []
    for r, pl in enumerate(plans):
        for m in pl.owned:
            x = torch.full((m.rows, m.cols), float("nan"))
            seen = torch.zeros(m.rows, m.cols, dtype=torch.int64)
            for pc in m.pieces:
                x[pc.box.slices()] = recv[r][pc.offset:pc.offset + pc.numel].view(pc.box.shape)
                seen[pc.box.slices()] += 1
            assert bool((seen == 1).all()), f"rank {r}: matrix {m.param} pieces overlap or miss"
            assert torch.equal(x, full[m.param])
        buf = recv[r] if pl.shared else torch.full((sum(pl.back_send_splits),), float("nan"))
        for m in pl.owned:
            for pc in m.returns:
                buf[pc.offset:pc.offset + pc.numel] = out[m.param][pc.box.slices()].reshape(-1)
        back_send.append(buf)
    back = alltoall(back_send, [pl.back_send_splits for pl in plans],
                    [pl.back_recv_splits for pl in plans])
    for r, pl in enumerate(plans):
        got = back[r]
        if pl.shared:   # the way back is the way out reversed: O lands where U left
            assert pl.back_offset == pl.send_offset
            assert (pl.back_send_splits, pl.back_recv_splits) == (pl.recv_splits, pl.send_splits)
        for i in infos:
            b = i.box(r)
            if b.numel:
                o = pl.back_offset[i.index]
                assert torch.equal(got[o:o + b.numel], out[i.index][b.slices()].reshape(-1)), (r, i.index)
    return plans, owners


def alltoall(bufs, sent, received):
    """all_to_all_single over lists: rank d receives, from each s in rank order, the
    ``sent[s][d]`` elements s placed for it (which must be what d expects)."""
    world = len(bufs)
    out = []
    for d in range(world):
        parts = []
        for s in range(world):
            assert sent[s][d] == received[d][s], (s, d, sent[s][d], received[d][s])
            start = sum(sent[s][:d])
            parts.append(bufs[s][start:start + sent[s][d]])
        out.append(torch.cat(parts) if parts else torch.empty(0))
    return out


SHAPES = [(7, 5), (1, 33), (2, 9), (24, 8), (8, 40), (6, 7)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fsdp_rows_are_the_special_case_and_share_their_buffers(world):
    infos = [info_of(j, s, rows_split(s, world)) for j, s in enumerate(SHAPES)]
    assert all(i.row_split for i in infos)   # stored as rows_per_rank, as before
    plans, _ = play(infos, world)
    assert all(pl.shared for pl in plans)
    # the same split given as boxes plans the same buffers
    boxed = [info_of(j, s, rows_split(s, world)) for j, s in enumerate(SHAPES)]
    for i in boxed:
        i.boxes, i.rows_per_rank = [i.box(r) for r in range(world)], []
    again, _ = play(boxed, world)
    for a, b in zip(plans, again):
        assert (a.send_splits, a.recv_splits, a.send_offset) == (b.send_splits, b.recv_splits, b.send_offset)


def test_hsdp_sends_each_piece_once_inside_the_owners_replica_and_o_to_every_replica():
    infos = [info_of(j, s, hsdp_split(s, 2, 2)) for j, s in enumerate(SHAPES)]
    plans, owners = play(infos, 4)
    for i, o in zip(infos, owners):
        for r in range(4):
            if r != o and i.index in plans[r].send_offset:
                assert r // 2 == o // 2, "U travels inside the owner's replica (its node)"
    assert not all(pl.shared for pl in plans)


@pytest.mark.parametrize("split", [colwise_split, rowwise_split])
def test_fsdp_tp_boxes(split):
    infos = [info_of(j, s, split(s, 2, 2)) for j, s in enumerate(SHAPES)]
    for i in infos:
        check_tiling(i.shape, i.boxes if i.boxes else [i.box(r) for r in range(4)], i.name)
    plans, _ = play(infos, 4)
    assert all(pl.shared for pl in plans)   # no box has two holders


def test_replicated_and_mixed_splits_in_one_bundle():
    w = 4
    splits = [rows_split(SHAPES[0], w), hsdp_split(SHAPES[1], 2, 2), colwise_split(SHAPES[2], 2, 2),
              rowwise_split(SHAPES[3], 2, 2), replicated(SHAPES[4], w), hsdp_split(SHAPES[5], 2, 2)]
    infos = [info_of(j, s, b) for j, (s, b) in enumerate(zip(SHAPES, splits))]
    play(infos, w)
    # the owner of a replicated matrix receives no U (its own copy stays home) and returns
    # O to every other holder
    plans, owners = play([info_of(0, (5, 6), replicated((5, 6), 3))], 3, owners=[1])
    assert [pl.send_splits for pl in plans] == [[0, 0, 0], [0, 30, 0], [0, 0, 0]]
    assert plans[1].recv_splits == [0, 30, 0] and plans[1].back_send_splits == [30, 30, 30]


def test_sources_pick_each_box_once():
    hs = hsdp_split((4, 3), 2, 2)       # ranks 0, 2 hold rows 0-1; ranks 1, 3 rows 2-3
    assert sources(hs, 0) == [True, True, False, False]
    assert sources(hs, 3) == [False, False, True, True]
    # an owner with an empty box: its replica's holders, by its index among equal boxes
    empty = hsdp_split((1, 3), 2, 2)    # ranks 1, 3 hold nothing
    assert sources(empty, 1) == [True, False, False, False]
    assert sources(empty, 3) == [False, False, True, False]


def test_row_counts_and_tiling_errors():
    assert row_counts((7, 5), rows_split((7, 5), 3)) == [3, 3, 1]
    assert row_counts((7, 5), hsdp_split((7, 5), 2, 2)) is None      # replicas
    assert row_counts((7, 5), rowwise_split((7, 5), 1, 2)) is None   # columns
    assert row_counts((2, 9), rows_split((2, 9), 4)) == [1, 1, 0, 0]
    with pytest.raises(ValueError, match="overlapping"):
        check_tiling((4, 4), [Box((0, 0), (3, 4)), Box((2, 0), (4, 4))], "w")
    with pytest.raises(ValueError, match="do not cover"):
        check_tiling((4, 4), [Box((0, 0), (2, 4)), Box((2, 0), (4, 3))], "w")
    with pytest.raises(ValueError, match="outside"):
        check_tiling((4, 4), [Box((0, 0), (5, 4))], "w")


def test_row_offset_refuses_boxes_by_name_and_placement():
    info = info_of(0, (7, 5), hsdp_split((7, 5), 2, 2))
    info.placement = "(Replicate(), Shard(dim=0)) on a 2x2 mesh"
    with pytest.raises(NotImplementedError, match=r"parameter w0 has placement \(Replicate\(\), "
                                                  r"Shard\(dim=0\)\) on a 2x2 mesh: a first row"):
        info.row_offset(1)
    assert info.local_shape(1) == (3, 5) and info.local_numel(3) == 15


@pytest.mark.parametrize("replicas, shards", [(2, 2), (2, 4), (3, 3)])
def test_hsdp_u_never_leaves_the_owners_replica_even_from_empty_shards(replicas, shards):
    """Rows fewer than shards leave some ranks an empty box; an owner among them still gets
    U from its own replica (its node), so only O crosses replicas."""
    w = replicas * shards
    infos = [info_of(j, s, hsdp_split(s, replicas, shards)) for j, s in enumerate(SHAPES)]
    for owner in range(w):
        plans, _ = play(infos, w, owners=[owner] * len(infos))
        for r in range(w):
            if plans[r].send_splits[owner] and r != owner:
                assert r // shards == owner // shards, (owner, r)
