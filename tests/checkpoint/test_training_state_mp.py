"""A transformers GPT-2 with tied embeddings, a frozen block and a BatchNorm-style buffer,
trained under FSDP2 + ZeroMuon at W=2 (real processes, gloo) and saved; then consolidated
and loaded by ``from_pretrained``, and loaded model-only at W=1 and W=3: every tensor bit
for bit what the run held."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

from offload_engine.checkpoint import load_checkpoint, save_checkpoint
from offload_engine.cli.main import main as cli_main
from helpers.zero_muon_harness import local_part, spawn

CONFIG = dict(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
              tie_word_embeddings=True)
FROZEN = "transformer.h.0."


class GPT2WithStats(GPT2LMHeadModel):
    """GPT-2 plus a persistent buffer updated in training (as BatchNorm's statistics)."""

    def __init__(self, config):
        super().__init__(config)
        self.register_buffer("stats", torch.zeros(4))


def build(seed: int):
    torch.manual_seed(seed)
    model = GPT2WithStats(GPT2Config(**CONFIG))
    for name, p in model.named_parameters():
        if name.startswith(FROZEN):
            p.requires_grad_(False)
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def shard(model, mesh):
    from torch.distributed.fsdp import fully_shard
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def full(t):
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def train_and_save(rank, world, mesh, tmp):
    from torch.distributed.tensor import DTensor
    from offload_engine.optim import ZeroMuon
    model = build(0)
    shard(model, mesh)
    opt = ZeroMuon([(n, p) for n, p in model.named_parameters() if p.requires_grad], lr=0.02,
                   adamw={"lr": 3e-3}, store={"nvme_paths": [os.path.join(tmp, "state")],
                                              "cpu_budget": "256KiB", "bucket_bytes": "16KiB"})
    for step in range(2):
        g = torch.Generator().manual_seed(100 + step)
        for name, p in model.named_parameters():
            grad = torch.randn(p.shape, generator=g)
            if p.requires_grad:
                p.grad = DTensor.from_local(local_part(grad, p).clone(), p.device_mesh, p.placements,
                                            run_check=False, shape=p.shape, stride=p.stride())
        opt.step()
        model.stats.add_(step + 1.5)
    save_checkpoint(os.path.join(tmp, "ck"), model, opt, 2, extra={"user": {"rank": rank}})
    torch.save(torch.rand(3), os.path.join(tmp, f"draw-{rank}.pt"))  # what a restored RNG draws next
    reference = {k: full(v).detach().clone() for k, v in model.state_dict().items()}
    if rank == 0:
        save_file({k: v.contiguous() for k, v in reference.items() if k != "lm_head.weight"},
                  os.path.join(tmp, "reference.safetensors"))
    opt.close()


def load_sharded(rank, world, mesh, tmp):
    model = build(seed=rank + 50)
    shard(model, mesh)
    user = {}
    # model only, at W=3, with the extra state and RNG states asked for: ranks 0 and 1 get
    # their own; rank 2 (beyond the saved world size) gets rank 0's extra, keeps its RNG
    assert load_checkpoint(os.path.join(tmp, "ck"), model, extra={"user": user}, rng=True) == 2
    assert user == {"rank": rank if rank < 2 else 0}
    draw = torch.rand(3)
    if rank < 2:
        assert torch.equal(draw, torch.load(os.path.join(tmp, f"draw-{rank}.pt")))
    else:
        assert not torch.equal(draw, torch.load(os.path.join(tmp, "draw-0.pt")))
    want = load_file(os.path.join(tmp, "reference.safetensors"))
    for name, p in model.named_parameters():
        assert torch.equal(p.to_local(), local_part(want[name], p)), (rank, name)
    assert torch.equal(model.stats, want["stats"])


@pytest.mark.multiprocess
def test_tied_frozen_and_buffer_round_trip_from_w2(tmp_path):
    tmp = str(tmp_path)
    spawn(2, train_and_save, tmp)
    want = load_file(os.path.join(tmp, "reference.safetensors"))
    assert not torch.equal(want["stats"], torch.zeros(4))

    # consolidate -> from_pretrained: the tied head re-tied, the frozen block and the buffer there
    out = os.path.join(tmp, "hf")
    assert cli_main(["consolidate", os.path.join(tmp, "ck"), out, "--verify"]) == 0
    GPT2Config(**CONFIG).save_pretrained(out)
    loaded, info = GPT2WithStats.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    state = loaded.state_dict()
    for name, w in want.items():
        assert torch.equal(state[name], w), name
    assert any(n.startswith(FROZEN) for n in want)

    lean = os.path.join(tmp, "lean")
    assert cli_main(["consolidate", os.path.join(tmp, "ck"), lean, "--exclude-frozen"]) == 0
    names = set(load_file(os.path.join(lean, "model.safetensors")))
    assert names == {n for n in want if not n.startswith(FROZEN)} and "stats" in names

    # model only at W=1 (a plain model, no process group) and at W=3 (FSDP2)
    plain = build(seed=9)
    assert load_checkpoint(os.path.join(tmp, "ck"), plain) == 2
    for name, v in plain.state_dict().items():
        assert torch.equal(v, want["transformer.wte.weight" if name == "lm_head.weight" else name]), name
    spawn(3, load_sharded, tmp)
