"""Train a small language model with FSDP2 and ZeroMuon, optimizer state on NVMe.

    torchrun --nproc-per-node 2 examples/train_fsdp2.py --store /nvme/zeromuon

Runs on CPU (gloo) or on GPUs (nccl). Every rank keeps its optimizer state in
<store>/rank{r}; the directory must not hold state from an earlier run.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

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
    opt = ZeroMuon(model.named_parameters(), lr=0.02, weight_decay=0.01,   # Muon options
                   adamw={"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.0},
                   store=store)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))

    # toy data: every sequence follows one fixed random successor table, so loss can fall
    successor = torch.randperm(args.vocab, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(100 + rank)   # each rank draws its own batches
    for step in range(args.steps):
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
    opt.close()                              # writes every dirty bucket home
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
