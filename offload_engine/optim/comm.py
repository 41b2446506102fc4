"""The two all_to_alls of a Muon bundle: each matrix's pieces to its owner, O back.

Every rank holds one box of each matrix (``boxes.py``; under FSDP2 a block of rows).
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

Buffers are allocated once per pipeline slot, sized for the largest bundle; nothing is
allocated per step. Bytes moved to or from other ranks are counted (a rank's own block is
copied locally by the collective and is not counted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .boxes import Box, full_box, row_box, sources

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


@dataclass
class OwnedMatrix:
    param: int
    rows: int
    cols: int
    pieces: list[Piece]                     # U as received, in the receive buffer
    returns: list[Piece] = field(default_factory=list)  # O to send back, in the back send buffer


@dataclass
class ExchangePlan:
    """Where a bundle's elements sit in the buffers of this rank, both ways."""

    send_splits: list[int]                 # way out: elements to each rank
    recv_splits: list[int]                 # way out: elements from each rank
    send_offset: dict[int, int]            # param -> offset of this rank's box of U in send
    owned: list[OwnedMatrix] = field(default_factory=list)
    local: bool = False                    # no exchange: receive buffer is the send buffer
    # the way back. ``shared``: it is the way out reversed, so O is sent from the receive
    # buffer and arrives in the send buffer; else it has buffers of its own
    shared: bool = True
    back_send_splits: list[int] = field(default_factory=list)   # O to each rank
    back_recv_splits: list[int] = field(default_factory=list)   # O from each rank
    back_offset: dict[int, int] = field(default_factory=dict)   # param -> this rank's box of O

    @property
    def send_numel(self) -> int:
        return sum(self.send_splits)

    @property
    def recv_numel(self) -> int:
        return sum(self.recv_splits)

    @property
    def back_send_numel(self) -> int:
        return 0 if self.shared else sum(self.back_send_splits)

    @property
    def back_recv_numel(self) -> int:
        return 0 if self.shared else sum(self.back_recv_splits)


def _boxes(info, world: int) -> list[Box]:
    """The box of every rank (row splits with one running offset: linear in ``world``)."""
    if info.boxes is not None:
        return info.boxes
    out, start = [], 0
    for g in range(world):
        n = info.rows_per_rank[g]
        out.append(row_box(info.shape, start, n))
        start += n
    return out


def plan_exchange(infos: list, owners: list[int], rank: int, world: int, distributed: bool) -> ExchangePlan:
    """The buffer layout of one Muon bundle on ``rank``; ``infos`` are its ParamInfos in
    bundle order, ``owners`` the rank that runs each one's Newton-Schulz."""
    if not distributed or world == 1:
        off, send_offset, owned = 0, {}, []
        for info in infos:
            send_offset[info.index] = off
            whole = [Piece(rank if distributed else 0, off, full_box((info.rows, info.row_numel)))]
            owned.append(OwnedMatrix(info.index, info.rows, info.row_numel, whole, whole))
            off += info.rows * info.row_numel
        return ExchangePlan([off], [off], send_offset, owned, local=True,
                            back_offset=send_offset)
    boxes = {info.index: _boxes(info, world) for info in infos}
    sends = {info.index: sources(boxes[info.index], o) for info, o in zip(infos, owners)}
    mine = list(zip(infos, owners))

    def carried(info, peer: int, way_out: bool) -> bool:
        """Does ``peer``'s box of ``info`` travel: on the way out only from its source, on
        the way back to every holder of a non-empty box."""
        return sends[info.index][peer] if way_out else boxes[info.index][peer].numel > 0

    def this_rank(way_out: bool) -> tuple[list[int], dict[int, int]]:
        """This rank's boxes, grouped by owner in rank order, in bundle order within one."""
        splits, offsets, off = [0] * world, {}, 0
        for dest in range(world):
            for info, owner in mine:
                if owner == dest and carried(info, rank, way_out):
                    n = boxes[info.index][rank].numel
                    offsets[info.index] = off
                    off += n
                    splits[dest] += n
        return splits, offsets

    def owner_side(way_out: bool) -> tuple[list[int], dict[int, list[Piece]]]:
        """The pieces of the matrices this rank owns, grouped by the rank they come from or
        go to in rank order, in bundle order within one."""
        splits, pieces, off = [0] * world, {i.index: [] for i, o in mine if o == rank}, 0
        for peer in range(world):
            for info, owner in mine:
                if owner == rank and carried(info, peer, way_out):
                    b = boxes[info.index][peer]
                    pieces[info.index].append(Piece(peer, off, b))
                    off += b.numel
                    splits[peer] += b.numel
        return splits, pieces

    send_splits, send_offset = this_rank(True)
    recv_splits, pieces = owner_side(True)
    back_recv_splits, back_offset = this_rank(False)
    back_send_splits, returns = owner_side(False)
    owned = [OwnedMatrix(i.index, i.rows, i.row_numel, pieces[i.index], returns[i.index])
             for i, o in mine if o == rank]
    # no replicated box: the way back is the way out reversed, in the same two buffers
    shared = (back_offset == send_offset and back_send_splits == recv_splits
              and back_recv_splits == send_splits)
    return ExchangePlan(send_splits, recv_splits, send_offset, owned, False, shared,
                        back_send_splits, back_recv_splits, back_offset)


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
        send = self.send[slot][:plan.send_numel]
        recv = send if plan.local else self.recv[slot][:plan.recv_numel]
        return send, recv

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
