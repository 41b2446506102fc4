"""The two all_to_alls of a Muon bundle: U row blocks to each matrix's owner, O back.

For bundle c, rank r packs its local rows of U (bf16) for every matrix into one send
buffer, grouped by destination (the owner) in rank order and, within a destination, in
bundle order. The owner receives, from each source in rank order, that source's rows of
each matrix it owns; rows of one matrix are therefore scattered over the receive buffer
and are copied into the Newton-Schulz workspace in rank order (rank order is row order
for Shard(0)). The owner writes O over the very same positions and the second all_to_all
runs with the buffers' roles swapped, so each rank receives O exactly where it put U.

Buffers are allocated once per pipeline slot, sized for the largest bundle; nothing is
allocated per step. Bytes moved to or from other ranks are counted (a rank's own block is
copied locally by the collective and is not counted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

BF16_BYTES = 2


@dataclass
class Piece:
    source: int        # rank that holds these rows
    offset: int        # first element in the receive buffer
    row_start: int     # first row in the full matrix
    rows: int


@dataclass
class OwnedMatrix:
    param: int
    rows: int
    cols: int
    pieces: list[Piece]


@dataclass
class ExchangePlan:
    """Where a bundle's elements sit in the send and receive buffers of this rank."""

    send_splits: list[int]                 # elements to each rank
    recv_splits: list[int]                 # elements from each rank
    send_offset: dict[int, int]            # param -> offset of this rank's rows in send
    owned: list[OwnedMatrix] = field(default_factory=list)
    local: bool = False                    # no exchange: receive buffer is the send buffer

    @property
    def send_numel(self) -> int:
        return sum(self.send_splits)

    @property
    def recv_numel(self) -> int:
        return sum(self.recv_splits)


def plan_exchange(infos: list, owners: list[int], rank: int, world: int, distributed: bool) -> ExchangePlan:
    """The buffer layout of one Muon bundle; ``infos`` are its ParamInfos in bundle order."""
    if not distributed or world == 1:
        off, send_offset, owned = 0, {}, []
        for info in infos:
            n = info.rows * info.row_numel
            send_offset[info.index] = off
            owned.append(OwnedMatrix(info.index, info.rows, info.row_numel,
                                     [Piece(rank if distributed else 0, off, 0, info.rows)]))
            off += n
        return ExchangePlan([off], [off], send_offset, owned, local=True)
    send_splits, recv_splits = [0] * world, [0] * world
    send_offset: dict[int, int] = {}
    off = 0
    for dest in range(world):
        for info, owner in zip(infos, owners):
            if owner == dest:
                send_offset[info.index] = off
                n = info.local_numel(rank)
                off += n
                send_splits[dest] += n
    owned = [OwnedMatrix(i.index, i.rows, i.row_numel, []) for i, o in zip(infos, owners) if o == rank]
    by_param = {m.param: m for m in owned}
    off = 0
    for src in range(world):
        for info, owner in zip(infos, owners):
            if owner != rank:
                continue
            n = info.local_numel(src)
            by_param[info.index].pieces.append(
                Piece(src, off, info.row_offset(src), info.rows_per_rank[src]))
            off += n
            recv_splits[src] += n
    return ExchangePlan(send_splits, recv_splits, send_offset, owned)


class Exchange:
    """Preallocated bf16 send/receive buffers (``slots`` of them) and the byte counters."""

    def __init__(self, group, rank: int, world: int, slots: int, max_send: int, max_recv: int,
                 device: torch.device | str = "cpu"):
        self.group, self.rank, self.world = group, rank, world
        self.send = [torch.zeros(max(max_send, 1), dtype=torch.bfloat16, device=device) for _ in range(slots)]
        self.recv = [torch.zeros(max(max_recv, 1), dtype=torch.bfloat16, device=device) for _ in range(slots)]
        self.reset_counters()

    def reset_counters(self) -> None:
        self.bytes_sent = 0
        self.bytes_received = 0
        self.calls = 0

    def buffers(self, slot: int, plan: ExchangePlan) -> tuple[torch.Tensor, torch.Tensor]:
        send = self.send[slot][:plan.send_numel]
        recv = send if plan.local else self.recv[slot][:plan.recv_numel]
        return send, recv

    def forward(self, slot: int, plan: ExchangePlan):
        """Start sending U to the owners; returns the Work (None for a local bundle)."""
        return self._start(slot, plan, backward=False)

    def backward(self, slot: int, plan: ExchangePlan):
        """Start returning O (written over U in the receive buffer) to the row holders."""
        return self._start(slot, plan, backward=True)

    def _start(self, slot: int, plan: ExchangePlan, backward: bool):
        """One all_to_all; the way back swaps the buffers' and the splits' roles."""
        if plan.local:
            return None
        send, recv = self.buffers(slot, plan)
        # elements this rank sends to / receives from each rank, and the buffers they use
        sent, received = ((plan.recv_splits, plan.send_splits) if backward
                          else (plan.send_splits, plan.recv_splits))
        src, dst = (recv, send) if backward else (send, recv)
        self._count(sent, received)
        return dist.all_to_all_single(dst, src, output_split_sizes=received,
                                      input_split_sizes=sent, group=self.group, async_op=True)

    def _count(self, sent_splits: list[int], received_splits: list[int]) -> None:
        self.calls += 1
        self.bytes_sent += BF16_BYTES * (sum(sent_splits) - sent_splits[self.rank])
        self.bytes_received += BF16_BYTES * (sum(received_splits) - received_splits[self.rank])
