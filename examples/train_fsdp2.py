"""Train a small language model with FSDP2 and ZeroMuon, optimizer state on NVMe.

    torchrun --nproc-per-node 2 examples/train_fsdp2.py --store /nvme/zeromuon --checkpoint ckpt

Runs on CPU (gloo) or on GPUs (nccl). Every rank keeps its optimizer state in
<store>/rank{r}. With --checkpoint, the run saves every --save-every steps (in the
background, keeping the last --keep-last) and at the end; running the same command again
resumes from the latest checkpoint, bit for bit, whatever state a crash left in --store.
Without a checkpoint to resume from, a --store holding an earlier run's state is refused.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from offload_engine.checkpoint import (load_checkpoint, resolve, save_checkpoint,
                                       save_checkpoint_async)
from offload_engine.errors import OffloadEngineError
from offload_engine.optim import ZeroMuon


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)   # Muon: 2-D hidden matrices
        self.proj = nn.Linear(dim, dim, bias=False)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class LM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)     # AdamW: an embedding, by name
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)                    # AdamW: 1-D
        self.lm_head = nn.Linear(dim, vocab, bias=False)  # AdamW: the output head, by name

    def forward(self, tokens):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True, help="directory on NVMe for the optimizer state")
    p.add_argument("--checkpoint", default=None, help="checkpoint folder: save here, resume "
                                                     "from its latest generation")
    p.add_argument("--save-every", type=int, default=10, help="steps between checkpoints")
    p.add_argument("--keep-last", type=int, default=2, help="checkpoints kept")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=32)
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)                     # the same initial weights on every rank
    model = LM(args.vocab, args.dim, args.layers, heads=4).to(device)
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)        # each rank keeps 1/world of every parameter
    fully_shard(model, mesh=mesh)

    store = {"nvme_paths": [args.store],     # each rank opens <store>/rank{r}
             "cpu_budget": "512KiB",         # pinned pool, smaller than the state: it streams
             "bucket_bytes": "64KiB"}        # real runs: GiBs of pool, 64 MiB buckets (default)
    if cuda:
        store["gpu_budget"] = "64MiB"        # staging for the buckets a step uses on the GPU
    resume = args.checkpoint is not None and has_checkpoint(args.checkpoint)
    try:
        # resuming: what a crash left in --store is newer than the checkpoint and possibly
        # torn, so it is discarded and load_checkpoint fills the state
        opt = ZeroMuon(model.named_parameters(), lr=0.02, weight_decay=0.01,   # Muon options
                       adamw={"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.0},
                       store=store, stale_store="discard" if resume else "refuse")
    except OffloadEngineError as e:          # e.g. --store holds an earlier run's state
        fail(rank, f"{e}\n(this script: pass --checkpoint with that run's checkpoint folder to "
                   f"resume it, or give --store an empty directory)")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    start = 0
    if resume:                               # model, optimizer, LR schedule and RNG states
        try:
            start = load_checkpoint(args.checkpoint, model, opt, extra={"lr_schedule": sched})
        except OffloadEngineError as e:      # a torn or corrupt checkpoint, another model
            fail(rank, e)
        if rank == 0:
            print(f"resumed from {resolve(args.checkpoint)} (step {start})", flush=True)

    # toy data: every sequence follows one fixed random successor table, so loss can fall;
    # each rank draws its own batches, batch `step` from its own seed: a resume needs no more
    successor = torch.randperm(args.vocab, generator=torch.Generator().manual_seed(1))
    pending = None
    for step in range(start, args.steps):
        gen = torch.Generator().manual_seed(1_000_003 * (100 + rank) + step)
        tokens = torch.empty(args.batch, args.seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, args.vocab, (args.batch,), generator=gen)
        for t in range(args.seq):
            tokens[:, t + 1] = successor[tokens[:, t]]
        tokens = tokens.to(device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()

        mean = loss.detach().clone()
        dist.all_reduce(mean)
        s = opt.last_step_stats
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {mean.item() / world:.4f}  "
                  f"nvme read {s.store_bytes_read['nvme']} B  "
                  f"written {s.store_bytes_written['nvme']} B  "
                  f"all_to_all {s.a2a_bytes_sent} B", flush=True)
        done = step + 1
        if args.checkpoint and done % args.save_every == 0 and done < args.steps:
            if pending is not None:
                pending.wait()               # one save in flight at a time
            pending = save_checkpoint_async(args.checkpoint, model, opt, step=done,
                                            extra={"lr_schedule": sched},
                                            keep_last=args.keep_last)
    if pending is not None:
        pending.wait()
    if args.checkpoint and start < args.steps:
        save_checkpoint(args.checkpoint, model, opt, step=args.steps,
                        extra={"lr_schedule": sched}, keep_last=args.keep_last)
        if rank == 0:
            print(f"checkpoint: {resolve(args.checkpoint)}", flush=True)
    opt.close()                              # writes every dirty bucket home
    dist.destroy_process_group()


def has_checkpoint(folder: str) -> bool:
    """True when ``folder`` names a generation to resume from (its ``latest`` file; a torn or
    corrupt one is then refused by load_checkpoint, never skipped)."""
    return os.path.isfile(os.path.join(folder, "latest"))


def fail(rank: int, error) -> None:
    """One line on stderr (rank 0) and exit 2: no traceback from every rank for bad input."""
    if rank == 0:
        print(f"train_fsdp2.py: {error}", file=sys.stderr, flush=True)
    dist.destroy_process_group()
    sys.exit(2)


if __name__ == "__main__":
    main()
