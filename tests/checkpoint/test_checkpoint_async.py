"""Asynchronous checkpoints: saving while the next steps run.

What a user relies on: the generation holds the parameters and state as they were when
``save_checkpoint_async`` was called, however far training got before the write finished;
training after the call is exactly what it would have been without a save; a failure
(a full disk, a rank that gives up) surfaces in ``wait()`` and leaves the previous
generation as the loadable one.

The writes are slowed down (a sleep before each) so the next steps certainly run while the
save is in progress; that is what makes the copy-on-acquire and the step's wait for the
parameters happen in every run.
"""

from __future__ import annotations

import errno
import json
import os
import time

import pytest
import torch

import offload_engine.checkpoint.rank_writer as rank_writer
from offload_engine.checkpoint import CheckpointError, load_checkpoint, resolve, save_checkpoint
from offload_engine.checkpoint import save_checkpoint_async
from offload_engine.optim import ZeroMuon
from helpers.checkpoint_runs import ADAMW, MUON, load_and_check, small_run, step_both, store
from helpers.zero_muon_harness import MIXED_SHAPES, assert_parity, make_pair, reference_optimizers, spawn


def slow_writes(params_delay: float, bucket_delay: float) -> None:
    """Slow this process's checkpoint writes (a sleep before each), as a slow disk would."""
    sink, write_params = rank_writer.RankWriter.sink, rank_writer.RankWriter.write_params

    def slow_sink(self, *args):
        time.sleep(bucket_delay)
        sink(self, *args)

    def slow_params(self):
        time.sleep(params_delay)
        write_params(self)

    rank_writer.RankWriter.sink = slow_sink
    rank_writer.RankWriter.write_params = slow_params


def train_save_async_and_go_on(rank, world, mesh, tmp):
    slow_writes(params_delay=0.05, bucket_delay=0.1)
    model, ref = make_pair(MIXED_SHAPES, mesh, seed=3)
    opt = ZeroMuon(model.named_parameters(), **MUON, adamw=ADAMW,
                   store=store(os.path.join(tmp, f"state-{rank}")))
    ref_opts = reference_optimizers(ref, MUON, ADAMW)
    step_both(model, ref, opt, ref_opts, range(3), rank, world)
    if rank == 0:  # what the checkpoint must hold: the state at the call
        torch.save({"model": ref.state_dict(), "opts": [o.state_dict() for o in ref_opts]},
                   os.path.join(tmp, "reference.pt"))
    pending = save_checkpoint_async(os.path.join(tmp, "ck"), model, opt, 3)
    assert not pending.done()  # returned while the writes are still going on
    # these steps change every bucket and every parameter
    step_both(model, ref, opt, ref_opts, (3, 4), rank, world)
    assert pending.wait(120) == os.path.join(tmp, "ck", "step-00000003")
    st = pending.stats
    assert st["step_waited_s"] > 0, "the step did not wait for the parameters to be written"
    assert st["inline_copies"] > 0, "no bucket was copied by the step (copy-on-acquire)"
    assert st["call_s"] < st["seconds"]
    # training went on exactly as without a save
    assert_parity(opt, model, ref, ref_opts, rank, world, "two steps during an async save")

    # a rank whose write fails: every rank's wait() raises, naming it; nothing is committed
    if rank == 1:
        def full_disk(self, store_name, index, start, tensor):
            raise OSError(errno.ENOSPC, "No space left on device", store_name)
        rank_writer.RankWriter.sink = full_disk
    pending = save_checkpoint_async(os.path.join(tmp, "ck"), model, opt, 5)
    with pytest.raises((CheckpointError, OSError), match="rank 1 failed|No space left"):
        pending.wait(120)
    assert not os.path.exists(os.path.join(tmp, "ck", "step-00000005"))

    # saving a committed step again: an error on every rank (rank 0 finds it), no hang
    with pytest.raises(FileExistsError, match="step-00000003: a checkpoint of step 3 is already"):
        save_checkpoint_async(os.path.join(tmp, "ck"), model, opt, 3)
    opt.close()


@pytest.mark.multiprocess
def test_async_save_holds_the_state_of_its_call_while_two_steps_run(tmp_path):
    tmp = str(tmp_path)
    spawn(2, train_save_async_and_go_on, tmp)
    ck = os.path.join(tmp, "ck")
    assert open(os.path.join(ck, "latest")).read().strip() == "step-00000003"
    failed = json.load(open(os.path.join(ck, "step-00000005.partial", "rank1", ".failed.json")))
    assert "No space left" in failed["error"]
    with pytest.raises(CheckpointError, match="torn"):
        resolve(ck, "step-00000005.partial")
    spawn(2, load_and_check, tmp, "ck", None)  # bitwise the state at the call, at W=2
    spawn(1, load_and_check, tmp, "ck", None)  # and resharded to W=1


def test_a_failed_async_save_keeps_the_previous_generation_and_training_goes_on(tmp_path):
    model, opt = small_run(str(tmp_path))
    ck = str(tmp_path / "ck")
    save_checkpoint(ck, model, opt, 2)
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    sink = rank_writer.RankWriter.sink
    calls = []

    def fails_on_third_bucket(self, store_name, index, start, tensor):
        calls.append(index)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device",
                          os.path.join(self.staging, store_name))
        sink(self, store_name, index, start, tensor)

    rank_writer.RankWriter.sink = fails_on_third_bucket
    try:
        pending = save_checkpoint_async(ck, model, opt, 3)
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5)
        opt.step()  # training goes on while (and after) the save fails
        with pytest.raises(OSError, match=f"No space left on device.*{ck}"):
            pending.wait(60)
    finally:
        rank_writer.RankWriter.sink = sink
    assert os.path.isdir(os.path.join(ck, "step-00000003.partial"))
    assert open(os.path.join(ck, "latest")).read().strip() == "step-00000002"
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    after_state = opt.state_dict()
    assert save_checkpoint(ck, model, opt, 4).endswith("step-00000004")  # the disk is back
    opt.close()

    for tag, params in (("step-00000002", want), ("step-00000004", after)):
        model2, opt2 = small_run(str(tmp_path), steps=0, name=f"load-{tag}")
        load_checkpoint(ck, model2, opt2, tag=tag)
        for n, p in model2.named_parameters():
            assert torch.equal(p, params[n]), (tag, n)
        if tag == "step-00000004":
            got = opt2.state_dict()["state"]
            for i, entry in after_state["state"].items():
                for k, v in entry.items():
                    assert torch.equal(got[i][k], v), (i, k)
        opt2.close()


def test_async_save_writes_state_with_buckets_kept_resident(tmp_path):
    """ZeroMuon keeps short last buckets acquired for its lifetime when the pool has room;
    a snapshot must still run (they lend no bytes) and copy them."""
    model, _ = make_pair(MIXED_SHAPES, None, seed=5)
    opt = ZeroMuon(model.named_parameters(), **MUON, adamw=ADAMW,
                   store={**store(str(tmp_path / "s")), "cpu_budget": 256 * 1024})
    assert opt._pinned, "this pool should leave room to keep the short tails"
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.01)
    opt.step()
    want = opt.state_dict()["state"]
    gen = save_checkpoint_async(str(tmp_path / "ck"), model, opt, 1).wait(60)
    opt.close()
    model2, opt2 = small_run(str(tmp_path), steps=0, name="load")
    load_checkpoint(os.path.dirname(gen), model2, opt2)
    got = opt2.state_dict()["state"]
    for i, entry in want.items():
        for k, v in entry.items():
            assert torch.equal(got[i][k], v), (i, k)
    opt2.close()


def test_buffers_and_mixed_dtype_parameters_round_trip_and_consolidate(tmp_path):
    """Persistent buffers (BatchNorm statistics, an int64 counter) are saved as they were at
    the call, even if a forward pass changes them while the save runs; they load back and
    consolidate bit for bit. Parameters of two dtypes pack into two arrays."""
    from safetensors.torch import load_file
    from torch import nn

    from offload_engine.cli.main import main as cli_main

    def make(seed):
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
        m[2].to(torch.bfloat16)  # bf16 after fp32 after... (two packed parameter arrays)
        m.register_buffer("scratch", torch.zeros(3), persistent=False)
        return m

    def forward(m, x):
        return m[2](m[1](m[0](x)).to(torch.bfloat16)).float().square().mean()

    model = make(0)
    opt = ZeroMuon(model.named_parameters(), lr=0.02, store=store(str(tmp_path / "s")))
    x = torch.randn(8, 12)
    for _ in range(2):
        forward(model, x).backward()
        opt.step()
        opt.zero_grad()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    assert int(want["1.num_batches_tracked"]) == 2
    pending = save_checkpoint_async(str(tmp_path / "ck"), model, opt, 2)
    forward(model, x).backward()  # changes the BatchNorm statistics while the save runs
    pending.wait(60)
    opt.step()
    opt.close()

    fresh = make(1)
    fresh.scratch.fill_(5)
    opt2 = ZeroMuon(fresh.named_parameters(), lr=0.02, store=store(str(tmp_path / "s2")))
    assert load_checkpoint(str(tmp_path / "ck"), fresh, opt2) == 2
    got = fresh.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    assert bool((fresh.scratch == 5).all())  # non-persistent: not saved, not touched
    opt2.close()

    out = str(tmp_path / "hf")
    assert cli_main(["consolidate", str(tmp_path / "ck"), out, "--verify"]) == 0
    tensors = load_file(os.path.join(out, "model.safetensors"))
    assert set(tensors) == set(want)
    for k in want:  # floats as fp32 (the default --dtype, as zero_to_fp32); integers as they are
        expect = want[k].float() if want[k].is_floating_point() else want[k]
        assert tensors[k].dtype == expect.dtype and torch.equal(tensors[k], expect), k

    other = make(2)
    other.register_buffer("extra", torch.zeros(2))
    opt3 = ZeroMuon(other.named_parameters(), lr=0.02, store=store(str(tmp_path / "s3")))
    with pytest.raises(CheckpointError, match="has no buffer 'extra'"):
        load_checkpoint(str(tmp_path / "ck"), other, opt3)
    opt3.close()
