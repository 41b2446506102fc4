"""Train a small mixture-of-experts model with expert parallelism and ZeroMuon.

    torchrun --nproc-per-node 2 examples/train_moe_ep.py --store /nvme/zeromuon --checkpoint ckpt

Expert parallelism as torchtitan does it: each grouped expert stack ``[E, out, in]`` is
``distribute_tensor(w, ep_mesh, [Shard(0)])``, so every rank holds E / world whole experts;
a token's hidden vector travels to the ranks of the experts its router chose (one
all_to_all), is processed there, and travels back (another). The dense parameters
(attention, router, norms, embedding, head) are FSDP2-sharded over the same ranks.

ZeroMuon orthogonalizes every expert as its own matrix, on the rank that holds it (no
exchange for experts), and exchanges the dense matrices as usual. Runs on CPU (gloo) or
GPUs (nccl). With ``--checkpoint DIR`` the run saves there at the end; ``offload-engine
consolidate DIR OUT`` then writes one safetensors tensor per expert stack (or per expert
with ``--experts per-expert``).
"""

import argparse
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.nn.functional import all_to_all_single
from torch.distributed.tensor import Shard, distribute_tensor

from offload_engine.checkpoint import save_checkpoint
from offload_engine.optim import ZeroMuon

# torch 2.13 marks the autograd all_to_all deprecated in favour of a private module; it is
# still the public, differentiable one
warnings.filterwarnings("ignore", message=".*all_to_all_single is deprecated.*")


class Experts(nn.Module):
    """E SwiGLU experts in three stacks (torchtitan's names): one matrix per expert on dim 0."""

    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, hidden, dim) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, dim, hidden) * hidden ** -0.5)
        self.w3 = nn.Parameter(torch.randn(experts, hidden, dim) * dim ** -0.5)

    def local(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The rank's own experts on tokens ``x``, grouped by local expert (``counts`` each).
        ``to_local()`` carries gradients back to the expert-parallel DTensor parameters."""
        w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w
                      for w in (self.w1, self.w2, self.w3))
        out, at = [], 0
        for e, n in enumerate(counts):
            h = x[at:at + n]
            out.append((F.silu(h @ w1[e].T) * (h @ w3[e].T)) @ w2[e].T)
            at += n
        return torch.cat(out) if out else x[:0]


class MoE(nn.Module):
    """Top-k token-choice routing over experts spread across the ranks of ``group``."""

    def __init__(self, experts: int, dim: int, hidden: int, top_k: int):
        super().__init__()
        self.top_k, self.num_experts = top_k, experts
        self.gate = nn.Linear(dim, experts, bias=False)   # the router: a matrix, on Muon
        self.experts = Experts(experts, dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, x = x.shape, x.reshape(-1, x.shape[-1])
        weights, chosen = self.gate(x).softmax(-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        world = dist.get_world_size()
        per_rank = self.num_experts // world
        # token copies sorted by expert: expert e lives on rank e // per_rank
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts)
        send = counts.view(world, per_rank).sum(1)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts)      # how many per (source rank, my expert)
        recv = recv_counts.view(world, per_rank).sum(1)
        routed = all_to_all_single(torch.empty(int(recv.sum()), x.shape[1], dtype=x.dtype,
                                               device=x.device),
                                   x[token], recv.tolist(), send.tolist())
        # regroup what arrived (by source rank, then expert) by expert, run, and undo
        by_src = recv_counts.view(world, per_rank)
        src_expert = torch.arange(per_rank, device=x.device).repeat(world).repeat_interleave(
            by_src.reshape(-1))
        regroup = src_expert.argsort(stable=True)
        y = torch.empty_like(routed)
        y[regroup] = self.experts.local(routed[regroup], by_src.sum(0).tolist())
        back = all_to_all_single(torch.empty(len(token), x.shape[1], dtype=x.dtype,
                                             device=x.device),
                                 y, send.tolist(), recv.tolist())
        w = weights.reshape(-1)[order]
        return torch.zeros_like(x).index_add(0, token, back * w[:, None]).reshape(shape)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, experts: int, top_k: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.moe = MoE(experts, dim, 2 * dim, top_k)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.moe(self.norm2(x))


class LM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, experts: int, top_k: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, 4, experts, top_k) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True, help="directory on NVMe for the optimizer state")
    p.add_argument("--checkpoint", default=None, help="save a checkpoint here at the end")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=4, help="experts per layer (a multiple of "
                                                          "the number of processes)")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=32)
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.experts % world:
        raise SystemExit(f"--experts {args.experts} must be a multiple of {world} processes")
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)                     # the same initial weights on every rank
    model = LM(args.vocab, args.dim, args.layers, args.experts, args.top_k).to(device)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
    experts = set()
    for layer in model.layers:               # experts: expert-parallel, whole experts per rank
        stacks = layer.moe.experts
        for name, w in list(stacks.named_parameters()):
            stacks.register_parameter(name, nn.Parameter(
                distribute_tensor(w.detach(), mesh, [Shard(0)])))
        experts |= set(stacks.parameters())
    for layer in model.layers:               # the rest: FSDP2 over the same ranks
        fully_shard(layer, mesh=mesh, ignored_params=experts)
    fully_shard(model, mesh=mesh, ignored_params=experts)

    store = {"nvme_paths": [args.store], "cpu_budget": "512KiB", "bucket_bytes": "64KiB"}
    if cuda:
        store["gpu_budget"] = "64MiB"
    opt = ZeroMuon(model.named_parameters(), lr=0.02, weight_decay=0.01,
                   adamw={"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.0}, store=store)

    successor = torch.randperm(args.vocab, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        tokens = torch.empty(args.batch, args.seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, args.vocab, (args.batch,), generator=gen)
        for t in range(args.seq):
            tokens[:, t + 1] = successor[tokens[:, t]]
        tokens = tokens.to(device)
        loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, args.vocab),
                               tokens[:, 1:].reshape(-1))
        loss.backward()
        # expert gradients came back through the all_to_all: each expert's holder has the sum
        # over every rank's tokens, already the data-parallel gradient; average like FSDP2
        for w in experts:
            w.grad.div_(world)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        s = opt.last_step_stats
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {mean.item() / world:.4f}  "
                  f"all_to_all (Muon) {s.a2a_bytes_sent} B", flush=True)
    if args.checkpoint:
        save_checkpoint(args.checkpoint, model, opt, step=args.steps)
        if rank == 0:
            print(f"checkpoint saved: {args.checkpoint}", flush=True)
    opt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
