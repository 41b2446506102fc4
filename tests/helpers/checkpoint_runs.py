"""Small ZeroMuon runs for the checkpoint tests: the optimizer options and store they use, a
step of ZeroMuon and its references on the same gradients, a short single-process run, and a
rank's load of a saved checkpoint checked bitwise against the saved reference."""

from __future__ import annotations

import os

import torch

from offload_engine.checkpoint import load_checkpoint, save_checkpoint
from offload_engine.optim import ZeroMuon

from helpers.zero_muon_harness import MIXED_SHAPES, assert_parity, make_pair, reference_optimizers, set_grads
MUON = dict(lr=0.02, weight_decay=0.1)
ADAMW = dict(lr=3e-3, weight_decay=0.01)
KiB = 1024


def store(path: str) -> dict:
    return {"nvme_paths": [path], "bucket_bytes": 4 * KiB, "cpu_budget": 16 * KiB,
            "prefetch_depth": 1, "io_threads": 2, "acquire_timeout_s": 30}


def step_both(model, ref, opt, ref_opts, steps, rank, world):
    """The same gradients into both models, then a step of ZeroMuon and of the reference."""
    for step in steps:
        set_grads(model, ref, step, rank, world)
        opt.step()
        for o in ref_opts:
            o.step()


def mixed_model(mesh, seed: int, store_dir: str):
    """(model, its unsharded reference, ZeroMuon, reference optimizers) for MIXED_SHAPES."""
    model, ref = make_pair(MIXED_SHAPES, mesh, seed=seed)
    opt = ZeroMuon(model.named_parameters(), **MUON, adamw=ADAMW, store=store(store_dir))
    return model, ref, opt, reference_optimizers(ref, MUON, ADAMW)


def load_and_check(rank, world, mesh, tmp, src, resave, setup=mixed_model):
    # different weights until loaded
    model, ref, opt, ref_opts = setup(mesh, 77, os.path.join(tmp, f"state-load-w{world}-{src}"))
    saved = torch.load(os.path.join(tmp, "reference.pt"))
    ref.load_state_dict(saved["model"])
    for o, sd in zip(ref_opts, saved["opts"]):
        o.load_state_dict(sd)
    assert load_checkpoint(os.path.join(tmp, src), model, opt) == 3
    assert_parity(opt, model, ref, ref_opts, rank, world, f"after load at W={world}")
    if resave:
        save_checkpoint(os.path.join(tmp, resave), model, opt, 3)
    step_both(model, ref, opt, ref_opts, (3, 4), rank, world)
    assert_parity(opt, model, ref, ref_opts, rank, world, f"two steps after load at W={world}")
    opt.close()


# -- single process helpers ------------------------------------------------------------------
def small_run(tmp, steps=2, name="run"):
    model, _ = make_pair(MIXED_SHAPES, None, seed=5)
    opt = ZeroMuon(model.named_parameters(), **MUON, adamw=ADAMW,
                   store=store(os.path.join(tmp, name)))
    for step in range(steps):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.01 * (step + 1))
        opt.step()
    return model, opt
