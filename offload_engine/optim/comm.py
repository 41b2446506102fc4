"""The two all_to_alls of a Muon bundle: each matrix's pieces to its owner, O back.

Every rank holds one box of each matrix (``boxes.py``; under FSDP2 a block of rows). A
matrix is a 2-D parameter or one expert of a 3-D stack (``matrices.py``): a rank's box of a
stack holds a box of each of its experts, so its local tensor is one run of elements per
matrix (``Run``), each going where that matrix's owner is.
Newton-Schulz needs the whole matrix on one rank, its owner, so for bundle c:

1. **U to the owner.** Rank r packs its box of U (bf16, row-major) for every matrix it is
   a *source* of into one send buffer, grouped by destination (the owner) in rank order
   and, within a destination, in bundle order. Each distinct box has one source
   (``boxes.sources``): the owner itself where it holds the box, else one holder of it, so
   replicas (HSDP, a replicated matrix) do not send the same piece twice. The owner
   receives, from each source in rank order, that source's box of each matrix it owns,
   and copies the pieces into its Newton-Schulz workspace.
2. **O back.** The owner sends every holder of every box, replicas included, its box of O;
   each rank receives, from each owner in rank order, its box of each matrix that owner
   has, and applies it.

Where no box has a second holder (FSDP2 on a 1-D mesh, FSDP + tensor parallel) the way
back is the way out reversed: the owner writes O over the very positions U arrived in
and the second all_to_all runs with the buffers' roles swapped, so each rank receives O
exactly where it put U (``ExchangePlan.shared``: two buffers per slot). With replicas the
way back has its own layout and two more buffers.

A matrix that one rank holds whole and no other rank holds any of (an expert under expert
parallelism, every matrix at world size 1: ``matrices.Matrix.kept``) is not exchanged: its
holder writes U after the exchanged part of its send buffer, orthogonalizes it there and
writes O over it. A bundle of kept matrices only runs no all_to_all at all
(``ExchangePlan.local``).

Buffers are allocated once per pipeline slot, sized for the largest bundle; nothing is
allocated per step. Bytes moved to or from other ranks are counted (a rank's own block is
copied locally by the collective and is not counted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .boxes import Box, full_box, sources
from .matrices import Matrix, matrices_of

BF16_BYTES = 2


@dataclass
class Piece:
    """One rank's box of a matrix in a buffer."""

    rank: int          # the rank that sends (way out) or receives (way back) these elements
    offset: int        # first element in the buffer
    box: Box           # where they belong in the full matrix (row-major inside the box)

    @property
    def numel(self) -> int:
        return self.box.numel


@dataclass(frozen=True)
class Run:
    """Elements ``[lo, hi)`` of a parameter's flat local tensor sit at buffer element ``at``:
    of the exchange buffers, or, ``kept``, of the send buffer past its exchanged part (a
    matrix this rank orthogonalizes where it is: O is written over U there)."""

    lo: int
    hi: int
    at: int
    kept: bool = False


@dataclass
class OwnedMatrix:
    param: int
    rows: int
    cols: int
    pieces: list[Piece]                     # U as received, in the receive buffer
    returns: list[Piece] = field(default_factory=list)  # O to send back, in the back send buffer
    expert: int = 0                         # which matrix of a stack (0 for a 2-D parameter)


@dataclass
class ExchangePlan:
    """Where a bundle's elements sit in the buffers of this rank, both ways."""

    send_splits: list[int]                 # way out: elements to each rank
    recv_splits: list[int]                 # way out: elements from each rank
    send_runs: dict[int, list[Run]]        # param -> where its local U goes (sorted by lo)
    owned: list[OwnedMatrix] = field(default_factory=list)
    local: bool = False                    # no matrix of the bundle is exchanged: no all_to_all
    # the way back. ``shared``: it is the way out reversed, so O is sent from the receive
    # buffer and arrives in the send buffer; else it has buffers of its own
    shared: bool = True
    back_send_splits: list[int] = field(default_factory=list)   # O to each rank
    back_recv_splits: list[int] = field(default_factory=list)   # O from each rank
    back_runs: dict[int, list[Run]] = field(default_factory=dict)  # param -> where its O is
    # matrices this rank holds whole and alone: U and O in the send buffer after the
    # exchanged part (pieces and returns at the same offsets), Newton-Schulz where they are
    kept: list[OwnedMatrix] = field(default_factory=list)
    kept_numel: int = 0

    @property
    def send_numel(self) -> int:
        """Elements of the send buffer the first all_to_all sends (kept matrices excluded)."""
        return sum(self.send_splits)

    @property
    def send_total(self) -> int:
        """Elements of the send buffer this bundle uses: exchanged and kept."""
        return self.send_numel + self.kept_numel

    @property
    def recv_numel(self) -> int:
        return sum(self.recv_splits)

    @property
    def back_send_numel(self) -> int:
        return 0 if self.shared else sum(self.back_send_splits)

    @property
    def back_recv_numel(self) -> int:
        return 0 if self.shared else sum(self.back_recv_splits)

    @property
    def send_offset(self) -> dict[int, int]:
        """param -> where its flat local U starts in the send buffer (one contiguous run:
        a 2-D matrix; a stack may have one run per expert, see ``send_runs``)."""
        return {p: rs[0].at - rs[0].lo for p, rs in self.send_runs.items() if rs}

    @property
    def back_offset(self) -> dict[int, int]:
        """param -> where its flat local O starts (as ``send_offset``, for the way back)."""
        return {p: rs[0].at - rs[0].lo for p, rs in self.back_runs.items() if rs}


def overlaps(runs: list[Run], lo: int, hi: int):
    """(a, b, at, kept) for every part of ``runs`` inside local elements ``[lo, hi)``: local
    elements ``[a, b)`` sit at buffer elements ``[at, at + b - a)``."""
    for r in runs:
        a, b = max(lo, r.lo), min(hi, r.hi)
        if a < b:
            yield a, b, r.at + a - r.lo, r.kept


def plan_matrices(infos: list, world: int, distributed: bool) -> list[Matrix]:
    """The matrices of a bundle in bundle order (param order, then expert order)."""
    return [m for info in infos for m in matrices_of(info, world, distributed)]


def plan_exchange(infos: list, owners: list, rank: int, world: int, distributed: bool) -> ExchangePlan:
    """The buffer layout of one Muon bundle on ``rank``; ``infos`` are its ParamInfos in
    bundle order, ``owners`` the rank that runs each matrix's Newton-Schulz, one per matrix
    of ``plan_matrices`` (for 2-D parameters: one per parameter); a kept matrix's entry is
    not read (its holder runs it)."""
    spread = distributed and world > 1
    me = rank if spread else 0
    mats = plan_matrices(infos, world, spread)
    exchanged = [(j, m, o) for j, (m, o) in enumerate(zip(mats, owners)) if not m.kept]
    sends = {j: sources(list(m.boxes), o) for j, m, o in exchanged}

    def carried(j: int, m: Matrix, peer: int, way_out: bool) -> bool:
        """Does ``peer``'s box of matrix ``j`` travel: on the way out only from its source,
        on the way back to every holder of a non-empty box."""
        return sends[j][peer] if way_out else m.boxes[peer].numel > 0

    def this_rank(way_out: bool) -> tuple[list[int], dict[int, list[Run]]]:
        """This rank's boxes, grouped by owner in rank order, in bundle order within one."""
        splits, runs, off = [0] * world, {}, 0
        for dest in range(world):
            for j, m, owner in exchanged:
                if owner == dest and carried(j, m, rank, way_out):
                    n = m.boxes[rank].numel
                    runs.setdefault(m.param, []).append(Run(m.starts[rank], m.starts[rank] + n, off))
                    off += n
                    splits[dest] += n
        return splits, runs

    def owner_side(way_out: bool) -> tuple[list[int], dict[int, list[Piece]]]:
        """The pieces of the matrices this rank owns, grouped by the rank they come from or
        go to in rank order, in bundle order within one."""
        splits, pieces, off = [0] * world, {j: [] for j, m, o in exchanged if o == rank}, 0
        for peer in range(world):
            for j, m, owner in exchanged:
                if owner == rank and carried(j, m, peer, way_out):
                    b = m.boxes[peer]
                    pieces[j].append(Piece(peer, off, b))
                    off += b.numel
                    splits[peer] += b.numel
        return splits, pieces

    if exchanged:
        send_splits, send_runs = this_rank(True)
        recv_splits, pieces = owner_side(True)
        back_recv_splits, back_runs = this_rank(False)
        back_send_splits, returns = owner_side(False)
    else:
        send_splits, recv_splits = [0] * world, [0] * world
        back_send_splits, back_recv_splits = [0] * world, [0] * world
        send_runs, back_runs, pieces, returns = {}, {}, {}, {}
    owned = [OwnedMatrix(m.param, m.rows, m.cols, pieces[j], returns[j], m.expert)
             for j, m, o in exchanged if o == rank]
    # no replicated box: the way back is the way out reversed, in the same two buffers
    shared = (back_runs == send_runs and back_send_splits == recv_splits
              and back_recv_splits == send_splits)
    # kept matrices: after the exchanged part of the send buffer, U and O in one place
    kept, at = [], sum(send_splits)
    for m in mats:
        if m.kept and m.keeper == me:
            whole = [Piece(me, at, full_box((m.rows, m.cols)))]
            kept.append(OwnedMatrix(m.param, m.rows, m.cols, whole, whole, m.expert))
            run = Run(m.starts[me], m.starts[me] + m.numel, at, kept=True)
            send_runs.setdefault(m.param, []).append(run)
            if not shared:
                back_runs.setdefault(m.param, []).append(run)
            at += m.numel
    if shared:
        back_runs = send_runs
    for runs in {id(r): r for r in (*send_runs.values(), *back_runs.values())}.values():
        runs.sort(key=lambda r: r.lo)
    return ExchangePlan(send_splits, recv_splits, send_runs, owned, not exchanged, shared,
                        back_send_splits, back_recv_splits, back_runs, kept,
                        at - sum(send_splits))


class Exchange:
    """Preallocated bf16 buffers (``slots`` sets of them) and the byte counters.

    Each slot has a send and a receive buffer; when some bundle's way back is not the way
    out reversed (``back_send``/``back_recv`` > 0: replicated boxes) also a back-send and a
    back-receive buffer."""

    def __init__(self, group, rank: int, world: int, slots: int, max_send: int, max_recv: int,
                 device: torch.device | str = "cpu", max_back_send: int = 0,
                 max_back_recv: int = 0):
        self.group, self.rank, self.world = group, rank, world
        bf16 = torch.bfloat16
        self.send = [torch.zeros(max(max_send, 1), dtype=bf16, device=device) for _ in range(slots)]
        self.recv = [torch.zeros(max(max_recv, 1), dtype=bf16, device=device) for _ in range(slots)]
        back = max_back_send or max_back_recv
        self.back_send = [torch.zeros(max(max_back_send, 1), dtype=bf16, device=device)
                          for _ in range(slots)] if back else []
        self.back_recv = [torch.zeros(max(max_back_recv, 1), dtype=bf16, device=device)
                          for _ in range(slots)] if back else []
        self.reset_counters()

    def reset_counters(self) -> None:
        self.bytes_sent = 0
        self.bytes_received = 0
        self.calls = 0

    def buffers(self, slot: int, plan: ExchangePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """(U out, U in) of ``slot``: this rank's boxes and, on an owner, the pieces."""
        return self.send[slot][:plan.send_numel], self.recv[slot][:plan.recv_numel]

    def kept_buffer(self, slot: int, plan: ExchangePlan) -> torch.Tensor:
        """The send buffer of ``slot`` as far as ``plan`` uses it: kept runs and pieces index
        it directly (they sit after the exchanged part)."""
        return self.send[slot][:plan.send_total]

    def back_buffers(self, slot: int, plan: ExchangePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """(O out, O in) of ``slot``: the owner's O for every holder, this rank's boxes of O."""
        if plan.shared:
            send, recv = self.buffers(slot, plan)
            return recv, send
        return (self.back_send[slot][:plan.back_send_numel],
                self.back_recv[slot][:plan.back_recv_numel])

    def forward(self, slot: int, plan: ExchangePlan):
        """Start sending U to the owners; returns the Work (None for a local bundle)."""
        if plan.local:
            return None
        send, recv = self.buffers(slot, plan)
        return self._start(send, recv, plan.send_splits, plan.recv_splits)

    def backward(self, slot: int, plan: ExchangePlan):
        """Start returning O to every holder of a box (None for a local bundle)."""
        if plan.local:
            return None
        send, recv = self.back_buffers(slot, plan)
        return self._start(send, recv, plan.back_send_splits, plan.back_recv_splits)

    def _start(self, src: torch.Tensor, dst: torch.Tensor, sent: list[int], received: list[int]):
        """One all_to_all of ``sent[g]`` elements to and ``received[g]`` from each rank g."""
        self._count(sent, received)
        return dist.all_to_all_single(dst, src, output_split_sizes=received,
                                      input_split_sizes=sent, group=self.group, async_op=True)

    def _count(self, sent_splits: list[int], received_splits: list[int]) -> None:
        self.calls += 1
        self.bytes_sent += BF16_BYTES * (sum(sent_splits) - sent_splits[self.rank])
        self.bytes_received += BF16_BYTES * (sum(received_splits) - received_splits[self.rank])
