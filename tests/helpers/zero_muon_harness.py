"""Spawned-process harness for the ZeroMuon tests: gloo process groups on CPU.

``spawn(world, fn, *args)`` runs ``fn(rank, world, mesh, *args)`` in ``world`` processes that
have joined one gloo group (file rendezvous: no ports) and a 1-D device mesh, one thread
each; ``spawn_mesh(shape, names, fn, *args)`` does the same with a device mesh of that
shape (e.g. ``(2, 2)``, ``("replicate", "shard")``). A failed assertion in any rank fails
the test with that rank's traceback.
"""

from __future__ import annotations

import copy
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def _entry(rank, world, init_file, fn, args, shape=None, names=None):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", shape or (world,), mesh_dim_names=names)
        fn(rank, world, mesh, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(world: int, fn, *args) -> None:
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_entry, args=(world, os.path.join(d, "rendezvous"), fn, args), nprocs=world, join=True)


def spawn_mesh(shape: tuple[int, ...], names: tuple[str, ...], fn, *args) -> None:
    """``spawn`` over ``prod(shape)`` processes with a device mesh of ``shape`` named ``names``."""
    world = 1
    for n in shape:
        world *= n
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_entry, args=(world, os.path.join(d, "rendezvous"), fn, args, shape, names),
                 nprocs=world, join=True)


# -- models -----------------------------------------------------------------------------------------
MIXED_SHAPES = {
    "embed_tokens": (11, 6),      # AdamW: embedding by name
    "w_tall": (24, 8),            # Muon: rows > cols
    "w_wide": (8, 40),            # Muon: cols > rows
    "w_odd": (7, 5),              # Muon: numel not divisible by W, uneven shards
    "w_short": (2, 9),            # Muon: rows < W for W = 3, 4 (empty shards)
    "w_row": (1, 33),             # Muon: [1, N]
    "w_big": (96, 64),            # Muon: spans several 4 KiB buckets
    "norm_weight": (8,),          # AdamW: 1-D
    "norm_bias": (8,),
    "bias": (40,),
    "lm_head": (11, 8),           # AdamW: output head by name
}


class Bag(nn.Module):
    """Parameters of the given shapes, nothing else (the optimizer sees only parameters)."""

    def __init__(self, shapes: dict, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.randn(shape, generator=g)))


def local_part(full: torch.Tensor, p) -> torch.Tensor:
    """The part of ``full`` that this rank holds of DTensor ``p`` (its box, as torch's DTensor
    computes it from the placements: rows under FSDP2, a rectangle under tensor parallel)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def set_grads(model, ref, step: int, rank: int, world: int, seed: int = 1000) -> None:
    """The same full gradient for both models; the sharded one gets its box as a DTensor
    with the parameter's placements."""
    from torch.distributed.tensor import DTensor
    g = torch.Generator().manual_seed(seed + step)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        q = ref_params[name]
        full = torch.randn(q.shape, generator=g)
        q.grad = full.to(q.dtype)
        full = full.to(p.dtype)
        if isinstance(p, DTensor):
            loc = local_part(full, p).clone()
            assert loc.shape == p.to_local().shape, (name, loc.shape, p.to_local().shape)
            p.grad = DTensor.from_local(loc, p.device_mesh, p.placements, run_check=False,
                                        shape=p.shape, stride=p.stride())
        else:
            p.grad = full.clone()


def reference_optimizers(ref, muon_kw: dict, adamw_kw: dict):
    from offload_engine.optim import default_use_muon
    muon = [p for n, p in ref.named_parameters() if default_use_muon(n, p)]
    adamw = [p for n, p in ref.named_parameters() if not default_use_muon(n, p)]
    opts = []
    if muon:
        opts.append(torch.optim.Muon(muon, **muon_kw))
    if adamw:
        opts.append(torch.optim.AdamW(adamw, **adamw_kw))
    return opts


def assert_parity(opt, model, ref, ref_opts, rank: int, world: int, where: str) -> None:
    """Parameters and every state tensor bitwise equal to the reference's rows."""
    from torch.distributed.tensor import DTensor
    ref_params = dict(ref.named_parameters())
    ref_state = {}
    for ro in ref_opts:
        for p, st in ro.state.items():
            ref_state[p] = st
    for name, p in model.named_parameters():
        q = ref_params[name]
        mine = p.to_local() if isinstance(p, DTensor) else p
        want = local_part(q.detach(), p) if isinstance(p, DTensor) else q.detach()
        if not torch.equal(mine, want):
            diff = (mine.double() - want.double()).abs().max().item() if mine.numel() else None
            raise AssertionError(f"{where}: parameter {name} differs (max |diff| {diff})")
    sd = opt.state_dict()
    index = {info.name: info.index for info in opt.infos}
    for name, p in model.named_parameters():
        q = ref_params[name]
        want_state = ref_state.get(q, {})
        have = sd["state"].get(index[name], {})
        have = {k: v for k, v in have.items() if k != "master_param"}
        if set(have) != set(want_state):
            raise AssertionError(f"{where}: state keys of {name}: {sorted(have)} vs {sorted(want_state)}")
        for k, v in want_state.items():
            h = have[k]
            h = h.to_local() if isinstance(h, DTensor) else h
            w = v if k == "step" else (local_part(v, p) if isinstance(p, DTensor) else v)
            if isinstance(p, DTensor) and k != "step":
                d = sd["state"][index[name]][k]
                assert tuple(d.placements) == tuple(p.placements), (name, k, d.placements)
            if not torch.equal(h, w):
                raise AssertionError(f"{where}: state {k} of {name} differs")


def make_pair(shapes: dict, mesh, seed: int = 0):
    """A model sharded with FSDP2 over ``mesh`` (None: plain) and its unsharded twin."""
    model = Bag(shapes, seed)
    ref = copy.deepcopy(model)
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard
        fully_shard(model, mesh=mesh)
    return model, ref
