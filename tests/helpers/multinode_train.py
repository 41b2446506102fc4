"""A tiny HSDP training run for tests/integration/test_multi_node.py, launched by torchrun on each "node".

    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT \
        --rdzv-id=JOB tests/helpers/multinode_train.py --store NODE_LOCAL_DIR --ckpt SHARED_DIR --out DIR

The mesh is (nodes, processes per node): replicate across nodes, shard within one (HSDP).
The optimizer state lives in ``--store`` (each node's own directory), checkpoints in
``--ckpt`` (every node the same). Resumes from the latest checkpoint there when there is
one. Writes, per global rank, its loss of every step (``--out/loss-rank{r}.jsonl``, exact:
``float.hex``) and, from rank 0 at the end, every parameter whole (``--out/final.pt``).
``--hang-after N`` sleeps after step N (once every rank has written ``ready-rank{r}`` with
its pid) so that the test can SIGKILL the run there; a failed save writes its message to
``error-rank{r}.txt`` before raising.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from offload_engine.checkpoint import load_checkpoint, save_checkpoint
from offload_engine.optim import ZeroMuon


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(16, 8)         # AdamW
        self.up = nn.Linear(8, 12, bias=False)          # Muon
        self.down = nn.Linear(12, 8, bias=False)        # Muon
        self.norm = nn.LayerNorm(8)                     # AdamW
        self.lm_head = nn.Linear(8, 16, bias=False)     # AdamW

    def forward(self, tokens):
        h = self.embed_tokens(tokens)
        h = h + self.down(torch.relu(self.up(h)))
        return self.lm_head(self.norm(h))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--hang-after", type=int, default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world // per_node, per_node),
                            mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = Tiny()
    fully_shard(model, mesh=mesh)
    opt = ZeroMuon(model.named_parameters(), lr=0.02, weight_decay=0.1,
                   adamw={"lr": 3e-3, "weight_decay": 0.01},
                   store={"nvme_paths": [a.store], "bucket_bytes": "4KiB", "cpu_budget": "16KiB"})
    start = 0
    if os.path.exists(os.path.join(a.ckpt, "latest")):
        start = load_checkpoint(a.ckpt, model, opt)
    os.makedirs(a.out, exist_ok=True)
    for step in range(start, a.steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, 16, (4, 7), generator=gen)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 16), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        with open(os.path.join(a.out, f"loss-rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "loss": loss.item().hex()}) + "\n")
        if (step + 1) % a.save_every == 0:
            try:
                save_checkpoint(a.ckpt, model, opt, step + 1)
            except Exception as e:
                with open(os.path.join(a.out, f"error-rank{rank}.txt"), "w") as f:
                    f.write(str(e))
                raise
        if a.hang_after == step:
            dist.barrier()
            with open(os.path.join(a.out, f"ready-rank{rank}"), "w") as f:
                f.write(str(os.getpid()))
            time.sleep(3600)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(full, os.path.join(a.out, "final.pt"))
    opt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
