"""Calibration: the plan against what ZeroMuon and its TieredStore really allocate and move.

A tiny Llama config goes through the whole plan (``build_plan``: config.json -> shapes ->
the optimizer's rule and layout -> placement -> the emitted store config); ZeroMuon then
runs on a real module with those parameter names, with that very config, at W=1 (plain
tensors) and W=2 (FSDP2 over gloo), state homed on NVMe (a pool smaller than the state,
so buckets are evicted and re-read) and on CPU. Per rank it checks:

- the arrays (names, dtypes, element counts) are those ZeroMuon registered;
- pinned bytes: the pool is the plan's ``cpu_budget``; with the CPU home, the bytes the
  state occupies after a step are the plan's;
- NVMe bytes read and written in every step equal the store's counters exactly (write-behind
  that lands after ``step()`` returns is added to its step); with fp32 master weights, whose
  buckets ZeroMuon holds across pipeline stages, within one bucket (which bucket the store
  keeps can then depend on whether a write-back is still in flight);
- files on disk: chunk files equal the plan's exactly, chunk files + zarr.json within 2%;
- all_to_all bytes, exchange buffers, Newton-Schulz workspace and scratch equal the plan's.

The plan's NVMe bytes come from replaying the step (plan/step_sim.py) with the store's own
ResidencyPolicy (store/policy.py): the rules are shared, so what this checks is the replay's
model around them (the pool's extents, the acquire/release sequence, kept tails) against
the real store, I/O timing included.
"""

import os
import time

import pytest
import torch
from torch import nn

from offload_engine.io.align import round_up
from offload_engine.optim import ZeroMuon
from offload_engine.plan.memory import (PlanOptions, compute_bytes, rank_states, rank_tables,
                                        store_metadata_bytes)
from offload_engine.plan.model_shapes import from_hf_config
from offload_engine.plan.placement import needed_pinned
from offload_engine.plan.planner import Machine, build_plan
from offload_engine.plan.traffic import step_io
from helpers.zero_muon_harness import spawn

BUCKET = 8192
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 97, "tie_word_embeddings": False}
STEPS = 5


def tiny_model():
    return from_hf_config(TINY_LLAMA, name="tiny-llama")


def build_module(shapes, dtype, seed=0):
    """A module whose named_parameters() are exactly the plan's tensors, in order."""
    g = torch.Generator().manual_seed(seed)
    root = nn.Module()
    for t in shapes.tensors:
        *path, leaf = t.name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, nn.Parameter(torch.randn(t.shape, generator=g).to(dtype)))
    assert [n for n, _ in root.named_parameters()] == [t.name for t in shapes.tensors]
    return root


def set_grads(module, step, rank, world):
    from torch.distributed.tensor import DTensor, Shard
    g = torch.Generator().manual_seed(100 + step)
    for p in module.parameters():
        full = torch.randn(p.shape, generator=g).to(p.dtype)
        if isinstance(p, DTensor):
            loc = list(torch.chunk(full, world, dim=0))
            loc = loc[rank] if rank < len(loc) else full[full.shape[0]:]
            p.grad = DTensor.from_local(loc.clone(), p.device_mesh, (Shard(0),), run_check=False,
                                        shape=p.shape, stride=p.stride())
        else:
            p.grad = full


def files_under(path):
    chunks = total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            size = os.path.getsize(os.path.join(root, f))
            total += size
            if os.path.basename(root) == "c":
                chunks += size
    return chunks, total


def wait_for_writes(store, timeout=10.0):
    """Let write-behind issued during the step land (so it is counted in that step)."""
    deadline = time.monotonic() + timeout
    while store.writes_in_flight and time.monotonic() < deadline:
        time.sleep(0.002)
    assert not store.writes_in_flight


CASES = [  # (home, param dtype, master weights, pinned budget in buckets or None)
    ("nvme", torch.bfloat16, False, 9),
    ("nvme", torch.float32, False, 11),
    ("nvme", torch.bfloat16, True, 45),
    ("cpu", torch.bfloat16, False, None),
    ("cpu", torch.bfloat16, True, None),
]


def run_case(rank, world, mesh, tmp, case):
    home, dtype, master, budget = case
    shapes = tiny_model()
    opts = PlanOptions(world_size=world, gpus_per_node=world, param_dtype=dtype,
                       master_weights=master, bucket_bytes=BUCKET, prefetch_depth=2,
                       device="cpu", gpu=False)
    store_dir = os.path.join(tmp, f"{home}-{dtype}-{master}")
    machine = Machine(cpu_mem=64 << 30, gpus_per_node=world, nvme_paths=[store_dir],
                      nvme_capacity=1 << 40)
    doc = build_plan(shapes, opts, machine, home=home,
                     cpu_budget=None if budget is None else budget * BUCKET, search=False)
    cfg = doc["store_config"]
    assert cfg["default_home"] == home
    st = rank_states(shapes, opts)[rank]
    homes = doc["placement"]["homes"]
    io = step_io(st, homes, cfg["cpu_budget"], opts.prefetch_depth)
    if home == "nvme":
        assert 0 < io.read_max < io.nvme_state, "the case should cache part of the state"

    module = build_module(shapes, dtype)
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard
        fully_shard(module, mesh=mesh)
    with ZeroMuon(module.named_parameters(), store=cfg, master_weights=master) as opt:
        store = opt.store
        # arrays: exactly what ZeroMuon registered
        assert {n: (a.dtype, a.numel) for n, a in st.arrays.items()} == {
            n: (a.dtype, a.numel) for n, a in opt.layout.arrays.items()}
        # pinned: the pool is the plan's cpu_budget
        assert store.pool.capacity == round_up(cfg["cpu_budget"]) == doc["per_rank"]["cpu"]["pinned_pool"]
        # the optimizer's own buffers
        gpu, host = compute_bytes(st, shapes, opts, 0)
        assert opt.exchange.send[0].numel() == max(st.send_max, 1)
        assert opt.exchange.recv[0].numel() == max(st.recv_max, 1)
        assert host["all_to_all_buffers"] == sum(t.numel() * 2 for t in opt.exchange.send + opt.exchange.recv)
        assert host["newton_schulz_workspace"] == sum(
            t.numel() * 2 for t in (opt.ns._x, opt.ns._y, opt.ns._gram, opt.ns._upd))
        for step in range(STEPS):
            set_grads(module, step, rank, world)
            opt.step()
            s = opt.last_step_stats
            wait_for_writes(store)
            late = store.stats(reset=True)
            read = s.store_bytes_read["nvme"] + late.bytes_read["nvme"]
            written = s.store_bytes_written["nvme"] + late.bytes_written["nvme"]
            if home == "cpu":
                assert read == written == 0
                assert store.pool.in_use == needed_pinned(st) <= doc["placement"]["state_pinned_bytes"]
            elif step >= 1:  # step 0 zero-fills: nothing to read
                kind = step % 2  # ZeroMuon reverses the order on odd steps
                want = (io.read[kind], io.written[kind])
                if not master:
                    assert (read, written) == want, (step, read, written, io)
                else:
                    # held masters: when a demand read finds write-backs still in flight, the
                    # store may keep one other bucket (I/O timing); never more than one
                    assert abs(read - want[0]) <= BUCKET and abs(written - want[1]) <= BUCKET, \
                        (step, read, written, io)
            if world > 1:
                assert s.a2a_bytes_sent == st.a2a_sent and s.a2a_bytes_received == st.a2a_received
        scratch = opt.resources.scratch.nbytes
        assert scratch == host["optimizer_scratch"], (scratch, host)
    if home == "nvme":
        # closing flushed every bucket: the files on disk are the plan's
        rank_dir = os.path.join(store_dir, f"rank{rank}")
        chunks, total = files_under(rank_dir)
        nv = doc["per_rank"]["nvme"] if rank == doc["per_rank"]["rank"] else None
        want_chunks = sum(a.file_bytes for a in st.arrays.values())
        assert chunks == want_chunks
        if nv is not None:
            assert nv["chunk_files"] == want_chunks
            assert abs(nv["total"] - total) <= 0.02 * total, (nv, total)
        # metadata: the arrays' zarr.json, the group's (with the tensor table) and the shard table
        meta = (sum(a.metadata_bytes() for a in st.arrays.values())
                + store_metadata_bytes(list(st.arrays.values()), [rank_dir],
                                       rank_tables(st, world)))
        assert abs((total - chunks) - meta) <= 0.1 * meta + 1024, (total - chunks, meta)


def worker(rank, world, mesh, tmp):
    for case in CASES:
        run_case(rank, world, mesh, tmp, case)
    if world > 1:
        import torch.distributed as dist
        dist.barrier()
        if rank == 0:  # per node: both ranks' files add up to the plan's node figure
            shapes = tiny_model()
            opts = PlanOptions(world_size=world, gpus_per_node=world, bucket_bytes=BUCKET,
                               prefetch_depth=2, device="cpu", gpu=False)
            store_dir = os.path.join(tmp, f"nvme-{torch.bfloat16}-False")
            doc = build_plan(shapes, opts, Machine(cpu_mem=64 << 30, gpus_per_node=world,
                                                   nvme_paths=[store_dir], nvme_capacity=1 << 40),
                             home="nvme", cpu_budget=9 * BUCKET, search=False)
            _, total = files_under(store_dir)
            assert abs(doc["per_node"]["nvme_bytes"] - total) <= 0.02 * total


def test_plan_matches_zero_muon_in_one_process(tmp_path):
    worker(0, 1, None, str(tmp_path))


@pytest.mark.multiprocess
def test_plan_matches_zero_muon_on_two_ranks(tmp_path):
    spawn(2, worker, str(tmp_path))


@pytest.mark.parametrize("master", [False, True])
def test_the_smallest_pool_the_plan_allows_is_the_one_zero_muon_accepts(tmp_path, master):
    from offload_engine.plan.placement import working_buckets
    shapes = tiny_model()
    opts = PlanOptions(world_size=1, gpus_per_node=1, master_weights=master, bucket_bytes=BUCKET,
                       device="cpu", gpu=False)
    st = rank_states(shapes, opts)[0]
    least = working_buckets(st.layout) * BUCKET
    machine = Machine(cpu_mem=64 << 30, gpus_per_node=1, nvme_paths=[str(tmp_path / "a")],
                      nvme_capacity=1 << 40)
    doc = build_plan(shapes, opts, machine, home="nvme", cpu_budget=least, search=False)
    assert doc["placement"]["nvme_working_set_bytes"] == least
    module = build_module(shapes, torch.bfloat16)
    with ZeroMuon(module.named_parameters(), store=doc["store_config"], master_weights=master):
        pass
    cfg = dict(doc["store_config"], cpu_budget=least - 4096, nvme_paths=[str(tmp_path / "b")])
    with pytest.raises(ValueError, match="too small"):
        ZeroMuon(module.named_parameters(), store=cfg, master_weights=master)
