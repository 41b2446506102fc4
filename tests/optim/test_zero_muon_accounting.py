"""What a ZeroMuon step moves: all_to_all bytes, store bytes, collectives, Newton-Schulz calls.

- all_to_all: each rank sends (and receives) 4*(W-1)/W * P_muon/W bytes per step when the
  matrices split evenly (bf16 U out, bf16 O back, a rank's own rows never leave it), and
  in general exactly what the shard sizes and owners say. No other collective runs in a step.
- store: each bucket not cached at the start of a step is read once, and every bucket is
  written once (the test flushes after each step so that write-behind lands in that step).
- gradient-accumulation micro-steps touch no state; Newton-Schulz runs once per matrix per
  step whatever the number of micro-steps.
- send/receive/workspace buffers are allocated once.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from offload_engine.optim import ZeroMuon
from helpers.zero_muon_harness import MIXED_SHAPES, make_pair, set_grads, spawn
from helpers.zero_muon_accounting import check_store_pass, step_only_all_to_all

KiB = 4096


def even_shapes(world):
    """2W matrices whose rows split evenly: every rank owns two, holds 1/W of each."""
    return {f"w{i}": (8 * world, 24) for i in range(2 * world)}


def _expected_a2a(opt, world, rank):
    """Bytes this rank sends per step, from shard sizes and owners alone."""
    sent = 0
    for info in opt.infos:
        if info.kind != "muon":
            continue
        mine = info.rows_per_rank[rank] * info.row_numel
        if opt.owner[info.index] == rank:
            sent += 2 * (info.numel - mine)          # O back to every other row holder
        else:
            sent += 2 * mine                         # my rows of U to the owner
    return sent


def a2a_worker(rank, world, mesh, tmp):
    for shapes, even in ((even_shapes(world), True), (MIXED_SHAPES, False)):
        model, ref = make_pair(shapes, mesh)
        cfg = {"nvme_paths": [os.path.join(tmp, f"a2a{even}")], "bucket_bytes": KiB,
               "cpu_budget": 16 * KiB}
        with ZeroMuon(model.named_parameters(), store=cfg) as opt:
            p_muon = sum(i.numel for i in opt.infos if i.kind == "muon")
            n_muon = sum(1 for i in opt.infos if i.kind == "muon")
            dist_chunks = sum(1 for c in opt.layout.bundles if c.kind == "muon")
            buffers = None
            for step in range(3):
                set_grads(model, ref, step, rank, world)
                step_only_all_to_all(opt)
                st = opt.last_step_stats
                expected = _expected_a2a(opt, world, rank)
                assert st.a2a_bytes_sent == expected, (st.a2a_bytes_sent, expected)
                assert st.a2a_bytes_received == expected
                if even:
                    assert st.a2a_bytes_sent == 4 * (world - 1) * p_muon // world // world, (world, st.a2a_bytes_sent, 4 * (world - 1) * p_muon / world / world, opt.owner)
                assert st.a2a_calls == (2 * dist_chunks if world > 1 else 0)
                ns = torch.tensor([st.ns_calls])
                dist.all_reduce(ns)
                assert int(ns) == n_muon
                now = [t.data_ptr() for t in opt.exchange.send + opt.exchange.recv]
                now += [opt.ns._x.data_ptr(), opt.ns._y.data_ptr()]
                now += [t.data_ptr() for t in opt.resources.scratch.buffers()]
                if buffers is not None:
                    assert now == buffers, "a step allocated new send/recv/workspace buffers"
                buffers = now
            sums = torch.tensor([st.a2a_bytes_sent, st.a2a_bytes_received])
            dist.all_reduce(sums)
            assert sums[0] == sums[1]


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_to_all_bytes_and_no_other_collectives(world, tmp_path):
    spawn(world, a2a_worker, str(tmp_path))


def test_store_bytes_one_pass_per_step_plain(tmp_path):
    model, ref = make_pair(MIXED_SHAPES, None)
    cfg = {"nvme_paths": [str(tmp_path)], "bucket_bytes": KiB, "cpu_budget": 5 * KiB,
           "prefetch_depth": 1}
    with ZeroMuon(model.named_parameters(), store=cfg) as opt:
        assert opt.layout.state_bytes() > 5 * KiB
        check_store_pass(opt, model, ref, 0, 1)


def test_cpu_home_moves_nothing_to_disk():
    model, ref = make_pair(MIXED_SHAPES, None)
    with ZeroMuon(model.named_parameters()) as opt:      # default store: pinned CPU
        for step in range(3):
            set_grads(model, ref, step, 0, 1)
            opt.step()
            st = opt.last_step_stats
            assert st.store_bytes_read["nvme"] == st.store_bytes_written["nvme"] == 0
            assert st.store_misses == 0 or step == 0


def store_and_accumulation_worker(rank, world, mesh, tmp):
    from helpers.zero_muon_cases import MLP
    from torch.distributed.fsdp import fully_shard
    model, ref = make_pair(MIXED_SHAPES, mesh)
    cfg = {"nvme_paths": [os.path.join(tmp, "store")], "bucket_bytes": KiB, "cpu_budget": 4 * KiB,
           "prefetch_depth": 1}
    with ZeroMuon(model.named_parameters(), store=cfg) as opt:
        check_store_pass(opt, model, ref, rank, world)
    # accumulation: micro-steps touch no state; NS runs once per matrix per step
    torch.manual_seed(0)
    mlp = MLP()
    fully_shard(mlp, mesh=mesh)
    cfg = {"nvme_paths": [os.path.join(tmp, "acc")], "bucket_bytes": KiB, "cpu_budget": 4 * KiB}
    with ZeroMuon(mlp.named_parameters(), store=cfg) as opt:
        n_muon = sum(1 for i in opt.infos if i.kind == "muon")
        for gas in (1, 4, 4):
            for micro in range(gas):
                mlp(torch.randint(0, 13, (2, 3))).pow(2).mean().backward()
            quiet = opt.store.stats(reset=True)
            assert quiet.hits + quiet.misses == 0 and quiet.bytes_read["nvme"] == 0
            assert quiet.bytes_written["nvme"] == 0
            opt.step()
            ns = torch.tensor([opt.last_step_stats.ns_calls])
            dist.all_reduce(ns)
            assert int(ns) == n_muon
            opt.zero_grad()
            opt.store.flush()           # write-behind lands now, not during the micro-steps
            opt.store.stats(reset=True)


@pytest.mark.multiprocess
def test_store_bytes_and_accumulation_across_ranks(tmp_path):
    spawn(2, store_and_accumulation_worker, str(tmp_path))
