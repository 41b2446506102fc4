"""Checkpoints of runs on 2-D meshes: saved at one mesh, loaded at another, bit for bit.

Real processes (gloo, CPU). HSDP 2x2 (``(Replicate(), Shard(0))``) saves at step 2: the
second replica writes nothing (its state is the first's), every shard table records rows.
That checkpoint loads into FSDP2 on a 1-D mesh of 3, which continues to step 4 and saves;
that one loads at W=1 (and the HSDP one directly too). FSDP + tensor parallel 2x2 (bf16
parameters, fp32 masters; colwise ``(_StridedShard(0), Shard(0))``, rowwise ``(Shard(0),
Shard(1))`` boxes, a replicated norm) saves boxes and loads at W=1. Every load is compared
with torch.optim.Muon + AdamW on the unsharded model (parameters and every state tensor,
bitwise), and so is every step after it; consolidate of each 2-D checkpoint equals the
unsharded model's weights (the fp32 masters where the run kept them). The live stores of
the 2-D runs list every parameter.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from offload_engine.checkpoint import load_checkpoint, save_checkpoint
from offload_engine.cli.main import main
from offload_engine.consolidate import get_fp32_state_dict
from offload_engine.formats.ours import OursSource
from offload_engine.optim import ZeroMuon
from helpers.consolidate_outputs import load_output
from helpers.zero_muon_cases import store_config
from helpers.zero_muon_harness import (MIXED_SHAPES, local_part, make_pair, reference_optimizers,
                               set_grads, spawn, spawn_mesh)
from helpers.zero_muon_meshes import TPBag, fsdp_tp, hsdp

pytestmark = pytest.mark.multiprocess

MUON, ADAMW = dict(lr=0.02, weight_decay=0.1), dict(lr=3e-3, weight_decay=0.01)
SEED = 3


def masters_store(path: str) -> dict:
    """NVMe-homed state with room for the fp32 masters' working set (1 KiB buckets)."""
    return dict(store_config("nvme_evict", path), cpu_budget=64 * 1024)


def grads(model, ref, step, rank, world, bf16):
    """The step's full gradients for both models (``set_grads``); with bf16 parameters the
    fp32 reference steps on the bf16 gradients widened, as the masters do."""
    set_grads(model, ref, step, rank, world)
    if bf16:
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            ref_params[name].grad = g.float()


def check(opt, model, ref, ref_opts, where: str, bf16: bool = False) -> None:
    """This rank's part of every parameter and state tensor equals the reference's, bitwise
    (bf16 runs: the parameter is the fp32 reference rounded, its master the reference)."""
    from torch.distributed.tensor import DTensor
    ref_state = {}
    for o in ref_opts:
        ref_state.update(o.state)
    sd = opt.state_dict()["state"]
    index = {i.name: i.index for i in opt.infos}
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        q = ref_params[name].detach()
        want = {"param": q.bfloat16() if bf16 else q, **ref_state.get(ref_params[name], {})}
        if bf16:
            want["master_param"] = q
        have = {"param": p.detach(), **sd.get(index[name], {})}
        assert set(have) == set(want), f"{where}: state keys of {name}: {sorted(have)} vs {sorted(want)}"
        for key, w in want.items():
            h = have[key]
            h = h.to_local() if isinstance(h, DTensor) else h
            if key != "step" and isinstance(p, DTensor):
                w = local_part(w, p)
            assert torch.equal(h, w), f"{where}: {key} of {name} differs"


def ref_steps(model, ref, ref_opts, steps, rank, world, bf16=False) -> None:
    """The reference alone through ``steps`` (the run being resumed took them)."""
    for step in steps:
        grads(model, ref, step, rank, world, bf16)
        for o in ref_opts:
            o.step()
            o.zero_grad()


def train(opt, model, ref, ref_opts, steps, rank, world, where, bf16=False) -> None:
    """Both through ``steps``, checked after each."""
    for step in steps:
        grads(model, ref, step, rank, world, bf16)
        for o in (opt, *ref_opts):
            o.step()
            o.zero_grad()
        check(opt, model, ref, ref_opts, f"{where} step {step}", bf16)


def check_live_store(opt, model, rank) -> None:
    """The live store's manifest lists every parameter, with this rank's bytes of it."""
    from torch.distributed.tensor import DTensor
    with OursSource(opt.store.root, "store") as src:
        listed = {t.name: t for t in src.tensors()}
        assert set(listed) == {n for n, _ in model.named_parameters()}
        for name, p in model.named_parameters():
            numel = p.to_local().numel() if isinstance(p, DTensor) else p.numel()
            for state in listed[name].states.values():
                assert state.bytes_by_rank == {rank: numel * state.dtype.itemsize}, name


def manifest(gen: str) -> dict:
    with open(os.path.join(gen, "zarr.json")) as f:
        return json.load(f)["attributes"]


# -- HSDP 2x2 -> FSDP 1-D W=3 -> W=1 -----------------------------------------------------------------
def hsdp_save(rank, world, mesh, tmp):
    model, ref = hsdp(mesh, SEED)
    ref_opts = reference_optimizers(ref, MUON, ADAMW)
    with ZeroMuon(model.named_parameters(), **MUON, adamw=ADAMW,
                  store=store_config("nvme_evict", os.path.join(tmp, "hsdp_store"))) as opt:
        train(opt, model, ref, ref_opts, range(2), rank, world, "HSDP 2x2")
        check_live_store(opt, model, rank)
        save_checkpoint(os.path.join(tmp, "ckpt"), model, opt, step=2)
    # resumed on the same mesh: a fresh model and optimizer continue bit for bit
    model2, _ = hsdp(mesh, seed=SEED + 1)
    with ZeroMuon(model2.named_parameters(), **MUON, adamw=ADAMW,
                  store=store_config("nvme_evict", os.path.join(tmp, "hsdp_store2"))) as opt2:
        assert load_checkpoint(os.path.join(tmp, "ckpt"), model2, opt2) == 2
        check(opt2, model2, ref, ref_opts, "HSDP 2x2 loaded")
        train(opt2, model2, ref, ref_opts, range(2, 3), rank, world, "HSDP 2x2 resumed")


def fsdp3_resume(rank, world, mesh, tmp):
    model, ref = make_pair(MIXED_SHAPES, mesh, seed=SEED + 1)  # other values: the load sets them
    _, ref = make_pair(MIXED_SHAPES, None, seed=SEED)
    ref_opts = reference_optimizers(ref, MUON, ADAMW)
    ref_steps(model, ref, ref_opts, range(2), rank, world)
    with ZeroMuon(model.named_parameters(), **MUON, adamw=ADAMW,
                  store=store_config("nvme_evict", os.path.join(tmp, "w3_store"))) as opt:
        assert load_checkpoint(os.path.join(tmp, "ckpt"), model, opt) == 2
        check(opt, model, ref, ref_opts, "W=3 loaded from HSDP 2x2")
        train(opt, model, ref, ref_opts, range(2, 4), rank, world, "W=3")
        save_checkpoint(os.path.join(tmp, "ckpt"), model, opt, step=4)


def w1_resume(tmp, tag, steps_done, total, build, bf16=False, master_weights=False):
    """Load generation ``tag`` at W=1 (this process, no process group) and go on to ``total``
    steps against the reference."""
    model, ref = build()
    ref_opts = reference_optimizers(ref, MUON, ADAMW)
    ref_steps(model, ref, ref_opts, range(steps_done), 0, 1, bf16)
    with ZeroMuon(model.named_parameters(), **MUON, adamw=ADAMW, master_weights=master_weights,
                  store=masters_store(os.path.join(tmp, f"w1_{tag}"))) as opt:
        assert load_checkpoint(os.path.join(tmp, "ckpt"), model, opt, tag=tag) == steps_done
        check(opt, model, ref, ref_opts, f"W=1 loaded {tag}", bf16)
        train(opt, model, ref, ref_opts, range(steps_done, total), 0, 1, f"W=1 from {tag}", bf16)
    return ref


def consolidated_equals(tmp, tag, ref) -> None:
    gen = os.path.join(tmp, "ckpt", tag)
    assert main(["consolidate", gen, os.path.join(tmp, f"hf_{tag}"), "--verify"]) == 0
    written, _ = load_output(os.path.join(tmp, f"hf_{tag}"))
    via_api = get_fp32_state_dict(gen)
    for name, q in ref.named_parameters():
        assert written[name].dtype == torch.float32
        assert torch.equal(written[name], q.detach()), name
        assert torch.equal(via_api[name], q.detach()), name


def test_hsdp_2x2_checkpoint_loads_at_w3_then_w1_bitwise(tmp_path):
    tmp = str(tmp_path)
    spawn_mesh((2, 2), ("replicate", "shard"), hsdp_save, tmp)
    gen = os.path.join(tmp, "ckpt", "step-00000002")
    attrs = manifest(gen)
    # version 4: written by a run with boxes; replica 1 (ranks 2, 3) wrote no array
    assert attrs["format_version"] == 4
    assert {name.split("/")[0] for name in attrs["arrays"]} == {"rank0", "rank1"}
    # its shard table and its training state (RNG states), no arrays
    assert sorted(os.listdir(os.path.join(gen, "rank2"))) == ["training_state", "zarr.json"]
    # HSDP's replica 0 holds whole rows in rank order: the tables record rows
    assert attrs["tensors"]["w_big"]["rows_per_rank"] == [48, 48, 0, 0]
    assert not any("boxes_per_rank" in t for t in attrs["tensors"].values())

    twin, ref2 = make_pair(MIXED_SHAPES, None, seed=SEED)
    ref_steps(twin, ref2, reference_optimizers(ref2, MUON, ADAMW), range(2), 0, 1)
    consolidated_equals(tmp, "step-00000002", ref2)

    spawn(3, fsdp3_resume, tmp)
    assert manifest(os.path.join(tmp, "ckpt", "step-00000004"))["format_version"] == 4

    def build():
        return make_pair(MIXED_SHAPES, None, seed=SEED + 1)[0], make_pair(MIXED_SHAPES, None, seed=SEED)[1]
    w1_resume(tmp, "step-00000004", 4, 6, build)      # HSDP -> W=3 -> W=1
    w1_resume(tmp, "step-00000002", 2, 4, build)      # HSDP -> W=1


# -- FSDP + TP 2x2 -> W=1 -----------------------------------------------------------------------------
def fsdp_tp_save(rank, world, mesh, tmp):
    model, ref = fsdp_tp(mesh, SEED, dtype=torch.bfloat16)
    ref_opts = reference_optimizers(ref, MUON, ADAMW)
    with ZeroMuon(model.named_parameters(), **MUON, adamw=ADAMW, master_weights=True,
                  store=masters_store(os.path.join(tmp, "tp_store"))) as opt:
        train(opt, model, ref, ref_opts, range(2), rank, world, "FSDP+TP 2x2", bf16=True)
        check_live_store(opt, model, rank)
        save_checkpoint(os.path.join(tmp, "ckpt"), model, opt, step=2)
    model2, _ = fsdp_tp(mesh, SEED + 1, dtype=torch.bfloat16)
    with ZeroMuon(model2.named_parameters(), **MUON, adamw=ADAMW, master_weights=True,
                  store=masters_store(os.path.join(tmp, "tp_store2"))) as opt2:
        assert load_checkpoint(os.path.join(tmp, "ckpt"), model2, opt2) == 2
        check(opt2, model2, ref, ref_opts, "FSDP+TP 2x2 loaded", bf16=True)
        train(opt2, model2, ref, ref_opts, range(2, 3), rank, world, "FSDP+TP resumed", bf16=True)


def test_fsdp_tp_2x2_checkpoint_saves_boxes_and_loads_at_w1_bitwise(tmp_path):
    tmp = str(tmp_path)
    spawn_mesh((2, 2), ("dp", "tp"), fsdp_tp_save, tmp)
    attrs = manifest(os.path.join(tmp, "ckpt", "step-00000002"))
    assert attrs["format_version"] == 4
    # rowwise (Shard(0), Shard(1)): four rectangles; down.weight is (5, 7): 3 + 2 rows, 4 + 3 columns
    assert attrs["tensors"]["down.weight"]["boxes_per_rank"] == [
        [[0, 0], [3, 4]], [[0, 4], [3, 3]], [[3, 0], [2, 4]], [[3, 4], [2, 3]]]
    # the SequenceParallel norm (Shard(0), Replicate()): each row block once, by tp rank 0
    assert attrs["tensors"]["norm.weight"]["rows_per_rank"] == [4, 0, 4, 0]

    def build():
        # the reference starts from the bf16 values widened, as fsdp_tp's twin does
        return TPBag(SEED + 1).to(torch.bfloat16), TPBag(SEED).to(torch.bfloat16).float()
    w1_resume(tmp, "step-00000002", 2, 4, build, bf16=True, master_weights=True)
    twin, ref2 = build()
    ref_steps(twin, ref2, reference_optimizers(ref2, MUON, ADAMW), range(2), 0, 1, True)
    consolidated_equals(tmp, "step-00000002", ref2)   # the fp32 masters
