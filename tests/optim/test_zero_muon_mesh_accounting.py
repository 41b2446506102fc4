"""What a ZeroMuon step moves on 2-D meshes and tensor-parallel placements: all_to_all
bytes equal the byte formulas of docs/optimizer.md ("Bytes per step"), and nothing else
is communicated.

- the exact formula, from every rank's box (gathered here with torch's own placement
  arithmetic, not the optimizer's) and the owners: a rank sends its box of U for each
  matrix whose box it is the source of (the owner if it holds that box, else the holder
  in the owner's replica) and, as an owner, every other holder's box of O; it
  receives the pieces of the matrices it owns from their sources and its box of O of
  every other matrix. bf16: 2 bytes an element.
- the closed forms when shards and owners are even: ``2·P·(W + S - 2)/(W·S)`` bytes
  each way per rank, W ranks, every matrix in S distinct boxes (HSDP 2x2: S = 2;
  FSDP + TP 2x2 and tensor parallel alone: S = W, which is ``4·(W-1)/W · P/W``, FSDP2's
  figure; a replicated matrix: S = 1).
- no collective but all_to_all_single in a step; Newton-Schulz once per matrix over all
  ranks, an even share on each (replicas included); buffers (the way back's too)
  allocated once; under HSDP each state bucket read and written once per step.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from offload_engine.optim import ZeroMuon
from helpers.zero_muon_accounting import (check_store_pass, expected_bytes, gathered_boxes,
                                         step_only_all_to_all)
from helpers.zero_muon_harness import Bag, set_grads, spawn, spawn_mesh
from helpers.zero_muon_meshes import fsdp_tp, hsdp, tp

pytestmark = pytest.mark.multiprocess
KiB = 4096


def check_step_counters(rank, world, model, ref, tmp, even_s=None):
    """Three steps: bytes equal the exact formula (and, for even shapes split into
    ``even_s`` boxes, the closed form), and nothing else is communicated."""
    boxes = gathered_boxes(model)
    cfg = {"nvme_paths": [tmp], "bucket_bytes": KiB, "cpu_budget": 16 * KiB}
    with ZeroMuon(model.named_parameters(), store=cfg) as opt:
        n_muon = sum(1 for i in opt.infos if i.kind == "muon")
        p_muon = sum(i.numel for i in opt.infos if i.kind == "muon")
        bundles = sum(1 for c in opt.layout.bundles if c.kind == "muon" and c.distributed)
        before = None
        for step in range(3):
            set_grads(model, ref, step, rank, world)
            step_only_all_to_all(opt)
            st = opt.last_step_stats
            assert (st.a2a_bytes_sent, st.a2a_bytes_received) == expected_bytes(opt, boxes, rank)
            if even_s is not None:
                s = even_s
                assert st.a2a_bytes_sent == st.a2a_bytes_received \
                    == 2 * p_muon * (world + s - 2) // (world * s), (st.a2a_bytes_sent, p_muon, s)
            assert st.a2a_calls == 2 * bundles
            ns = torch.tensor([st.ns_calls])
            dist.all_reduce(ns)
            assert int(ns) == n_muon
            if even_s is not None:   # replicas split the Newton-Schulz work too: an even share
                assert st.ns_calls == n_muon // world, (st.ns_calls, n_muon, world)
            ex = opt.exchange
            now = [t.data_ptr() for t in ex.send + ex.recv + ex.back_send + ex.back_recv]
            assert before is None or now == before, "a step allocated new buffers"
            before = now
        return opt.last_step_stats


def linears(n: int, shape: tuple[int, int]) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Module()
    for i in range(n):
        m.add_module(f"l{i}", nn.Linear(shape[1], shape[0], bias=False))
    return m


def mesh_worker(rank, world, mesh, tmp):
    import copy
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    # HSDP 2x2 (the mesh's first dimension replicates, the second shards)
    model, ref = hsdp(mesh)
    check_step_counters(rank, world, model, ref, os.path.join(tmp, "hsdp"))
    model = Bag({f"w{i}": (8, 24) for i in range(2 * world)})
    ref = copy.deepcopy(model)
    fully_shard(model, mesh=mesh)
    st = check_step_counters(rank, world, model, ref, os.path.join(tmp, "hsdp_even"), even_s=2)
    assert st.a2a_bytes_sent == 2 * 8 * 8 * 24 * (4 + 2 - 2) // 8   # P bytes: 1536
    # each replica keeps the state of its shard, streamed once per step
    model, ref = hsdp(mesh)
    cfg = {"nvme_paths": [os.path.join(tmp, "hsdp_store")], "bucket_bytes": KiB,
           "cpu_budget": 4 * KiB, "prefetch_depth": 1}
    with ZeroMuon(model.named_parameters(), store=cfg) as opt:
        check_store_pass(opt, model, ref, rank, world)
    # FSDP + tensor parallel 2x2
    model, ref = fsdp_tp(mesh)
    check_step_counters(rank, world, model, ref, os.path.join(tmp, "fsdp_tp"))
    model = linears(8, (16, 24))
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh["tp"], {f"l{i}": ColwiseParallel() if i % 2 else RowwiseParallel()
                                           for i in range(8)})
    fully_shard(model, mesh=mesh["dp"])
    check_step_counters(rank, world, model, ref, os.path.join(tmp, "fsdp_tp_even"), even_s=world)


def test_hsdp_and_fsdp_tp_2x2_bytes_equal_the_formulas(tmp_path):
    spawn_mesh((2, 2), ("dp", "tp"), mesh_worker, str(tmp_path))


def tp_worker(rank, world, mesh, tmp):
    import copy
    from torch.distributed.tensor import distribute_module
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    model, ref = tp(mesh)
    check_step_counters(rank, world, model, ref, os.path.join(tmp, "tp"))
    model = linears(6, (12, 18))
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh, {f"l{i}": ColwiseParallel() if i % 2 else RowwiseParallel()
                                     for i in range(6)})
    check_step_counters(rank, world, model, ref, os.path.join(tmp, "tp_even"), even_s=world)
    model = linears(3, (12, 18))      # replicated matrices: each rank owns one, sends O twice
    ref = copy.deepcopy(model)
    distribute_module(model, mesh)
    st = check_step_counters(rank, world, model, ref, os.path.join(tmp, "rep_even"), even_s=1)
    assert st.a2a_bytes_sent == 2 * 2 * 12 * 18


def test_tp_on_a_1d_mesh_of_3_bytes_equal_the_formulas(tmp_path):
    spawn(3, tp_worker, str(tmp_path))
