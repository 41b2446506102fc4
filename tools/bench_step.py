#!/usr/bin/env python3
"""Optimizer step time and bytes of ZeroMuon against torch.optim.Muon and DeepSpeed (JSON).

A ~100M-parameter transformer-shaped model (embedding, N blocks of q/k/v/o and MLP
matrices with norms, an output head) trains on random tokens on CPU. Configurations:

- ``torch_muon_w1``: torch.optim.Muon (matrices) + torch.optim.AdamW (the rest), one
  process, full model, state in memory: the numerical reference and the in-memory floor.
- ``zero_muon_w{W}_nvme``: ZeroMuon on FSDP2 at world size W (gloo), state on NVMe with a
  pinned budget smaller than the state, so every step reads and writes most of it.
- ``zero_muon_w{W}_cpu``: the same with the state in pinned host memory (no disk).
- ``deepspeed_zero3_muon_nvme_w{W}``: DeepSpeed ZeRO-3 with its Muon optimizer and the
  optimizer state offloaded to NVMe (DS_ACCELERATOR=cpu), run with the interpreter given by
  ``--deepspeed-python`` (a venv with deepspeed 0.19.8 that sees this repo's torch), when given.

Per configuration and rank, per measured step: forward+backward seconds, optimizer-step
seconds (DeepSpeed orthogonalizes inside backward at the accumulation boundary, so compare
``iteration_s`` as well as ``step_s``), all_to_all bytes, store bytes, and disk bytes from
/proc/self/io (all threads of the process: an independent check, also for DeepSpeed).
Medians over the measured steps, then over ranks where it says so.

    python tools/bench_step.py --path /nvme/bench --world 2 --steps 4 \\
        [--deepspeed-python /tmp/dsvenv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


# -- the model ------------------------------------------------------------------------------------
def build_model(vocab: int, dim: int, layers: int, seed: int = 0):
    import torch
    from torch import nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
            self.up = nn.Linear(dim, 4 * dim, bias=False)
            self.down = nn.Linear(4 * dim, dim, bias=False)

        def forward(self, x):
            h = self.norm1(x)
            x = x + self.o(self.v(h) * torch.sigmoid(self.q(h) * self.k(h)))  # gating, not attention:
            return x + self.down(F.gelu(self.up(self.norm2(x))))              # the optimizer is measured

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm = nn.LayerNorm(dim)
            self.lm_head = nn.Linear(dim, vocab, bias=False)

        def forward(self, tokens):
            x = self.embed_tokens(tokens)
            for b in self.blocks:
                x = b(x)
            return self.lm_head(self.norm(x))

    torch.manual_seed(seed)
    return Net()


def loss_of(model, tokens):
    import torch.nn.functional as F
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def proc_io() -> tuple[int, int]:
    try:
        with open("/proc/self/io") as f:
            d = dict(line.split(": ") for line in f.read().splitlines())
        return int(d["read_bytes"]), int(d["write_bytes"])
    except OSError:
        return 0, 0


def peak_rss_bytes() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _median(xs):
    return statistics.median(xs) if xs else None


# -- workers (one process per rank) ----------------------------------------------------------------
def _rank_main(rank, world, a, out_prefix):
    import torch
    torch.set_num_threads(max(1, a["threads"]))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a["port"]), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    cfg = a["config"]
    model = build_model(a["vocab"], a["dim"], a["layers"])
    result = {"rank": rank, "params": sum(p.numel() for p in model.parameters())}
    gen = torch.Generator().manual_seed(1000 + rank)
    tokens = lambda: torch.randint(0, a["vocab"], (a["batch"], a["seq"] + 1), generator=gen)
    steps = []

    if cfg == "torch_muon_w1":
        from offload_engine.optim import default_use_muon
        muon = [p for n, p in model.named_parameters() if default_use_muon(n, p)]
        rest = [p for n, p in model.named_parameters() if not default_use_muon(n, p)]
        opts = [torch.optim.Muon(muon, lr=0.02, weight_decay=0.1),
                torch.optim.AdamW(rest, lr=3e-4, weight_decay=0.01)]
        result["muon_params"] = sum(p.numel() for p in muon)
        for i in range(a["warmup"] + a["steps"]):
            io0 = proc_io()
            t0 = time.perf_counter()
            loss_of(model, tokens()).backward()
            t1 = time.perf_counter()
            for o in opts:
                o.step()
            t2 = time.perf_counter()
            for o in opts:
                o.zero_grad()
            io1 = proc_io()
            if i >= a["warmup"]:
                steps.append({"fwd_bwd_s": t1 - t0, "step_s": t2 - t1,
                              "disk_read": io1[0] - io0[0], "disk_write": io1[1] - io0[1]})
    elif cfg.startswith("zero_muon"):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from offload_engine.optim import ZeroMuon
        dist.init_process_group("gloo", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if cfg.endswith("nvme"):
            store = {"nvme_paths": [os.path.join(a["path"], cfg)], "cpu_budget": a["cpu_budget"],
                     "bucket_bytes": a["bucket_bytes"], "prefetch_depth": 2}
        else:
            store = None
        opt = ZeroMuon(model.named_parameters(), lr=0.02, weight_decay=0.1,
                       adamw=dict(lr=3e-4, weight_decay=0.01), store=store)
        result["muon_params"] = sum(i.numel for i in opt.infos if i.kind == "muon")
        result["state_bytes_per_rank"] = opt.layout.state_bytes()
        result["chunks"] = len(opt.layout.chunks)
        for i in range(a["warmup"] + a["steps"]):
            io0 = proc_io()
            t0 = time.perf_counter()
            loss_of(model, tokens()).backward()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            opt.zero_grad()
            io1 = proc_io()
            st = opt.last_step_stats
            if i >= a["warmup"]:
                steps.append({"fwd_bwd_s": t1 - t0, "step_s": t2 - t1,
                              "disk_read": io1[0] - io0[0], "disk_write": io1[1] - io0[1],
                              "a2a_bytes_sent": st.a2a_bytes_sent,
                              "a2a_bytes_received": st.a2a_bytes_received,
                              "store_nvme_read": st.store_bytes_read["nvme"],
                              "store_nvme_written": st.store_bytes_written["nvme"],
                              "store_io_wait_s": st.store_io_wait_s, "comm_wait_s": st.comm_wait_s,
                              "ns_s": st.ns_s, "ns_calls": st.ns_calls})
        opt.close()
        dist.destroy_process_group()
    elif cfg.startswith("deepspeed"):
        os.environ["DS_ACCELERATOR"] = "cpu"
        import deepspeed
        from offload_engine.optim import default_use_muon
        deepspeed.init_distributed(dist_backend="gloo")
        for n, p in model.named_parameters():
            p.use_muon = default_use_muon(n, p)
        result["muon_params"] = sum(p.numel() for p in model.parameters() if p.use_muon)
        nvme = os.path.join(a["path"], cfg)
        os.makedirs(nvme, exist_ok=True)
        ds_cfg = {
            "train_micro_batch_size_per_gpu": a["batch"], "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1,
                                                     "adam_lr": 3e-4, "adam_weight_decay": 0.01}},
            # DeepSpeed refuses Muon with reduce_scatter (stage3.py): its Muon path all-reduces
            "zero_optimization": {"stage": 3, "sub_group_size": a["bucket_bytes"] // 4, "reduce_scatter": False,
                                  "offload_optimizer": {"device": "nvme", "nvme_path": nvme,
                                                        "pin_memory": False, "buffer_count": 4}},
            "aio": {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1,
                    "single_submit": False, "overlap_events": True},
            "wall_clock_breakdown": False, "steps_per_print": 10 ** 9,
        }
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=ds_cfg)
        for i in range(a["warmup"] + a["steps"]):
            io0 = proc_io()
            t0 = time.perf_counter()
            loss = loss_of(engine, tokens())
            engine.backward(loss)
            t1 = time.perf_counter()
            engine.step()
            t2 = time.perf_counter()
            io1 = proc_io()
            if i >= a["warmup"]:
                steps.append({"fwd_bwd_s": t1 - t0, "step_s": t2 - t1,
                              "disk_read": io1[0] - io0[0], "disk_write": io1[1] - io0[1]})
    else:
        raise SystemExit(f"unknown config {cfg}")
    result["steps"] = steps
    result["peak_rss_bytes"] = peak_rss_bytes()
    with open(f"{out_prefix}.rank{rank}.json", "w") as f:
        json.dump(result, f)


def worker(a: dict) -> None:
    import torch.multiprocessing as mp
    world = a["world"]
    with tempfile.TemporaryDirectory() as d:
        prefix = os.path.join(d, "out")
        if world == 1 and a["config"] == "torch_muon_w1":
            _rank_main(0, 1, a, prefix)
        else:
            mp.spawn(_rank_main, args=(world, a, prefix), nprocs=world, join=True)
        ranks = []
        for r in range(world):
            with open(f"{prefix}.rank{r}.json") as f:
                ranks.append(json.load(f))
    print("BENCH_RESULT " + json.dumps(ranks))


# -- the driver ---------------------------------------------------------------------------------------
def summarize(ranks: list[dict]) -> dict:
    keys = [k for k in ranks[0]["steps"][0]] if ranks[0]["steps"] else []
    per_rank = [{k: _median([s[k] for s in r["steps"]]) for k in keys} for r in ranks]
    out = {
        "params": ranks[0]["params"], "muon_params": ranks[0].get("muon_params"),
        "world": len(ranks),
        # the slowest rank sets the pace of a synchronous step
        "step_s": max(p["step_s"] for p in per_rank),
        "fwd_bwd_s": max(p["fwd_bwd_s"] for p in per_rank),
        "iteration_s": max(p["step_s"] + p["fwd_bwd_s"] for p in per_rank),
        "step_s_runs": [[s["step_s"] for s in r["steps"]] for r in ranks],
        "disk_read_bytes_per_step": [p["disk_read"] for p in per_rank],
        "disk_write_bytes_per_step": [p["disk_write"] for p in per_rank],
        "peak_rss_bytes": [r["peak_rss_bytes"] for r in ranks],
    }
    for k in ("a2a_bytes_sent", "a2a_bytes_received", "store_nvme_read", "store_nvme_written",
              "store_io_wait_s", "comm_wait_s", "ns_s", "ns_calls"):
        if k in keys:
            out[k + "_per_step"] = [p[k] for p in per_rank]
    for k in ("state_bytes_per_rank", "chunks"):
        if k in ranks[0]:
            out[k] = [r[k] for r in ranks]
    if "a2a_bytes_sent" in keys and out["muon_params"]:
        w = out["world"]
        out["a2a_formula_bytes"] = 4 * (w - 1) / w * out["muon_params"] / w
    return out


def run_config(python: str, args, config: str, world: int, threads: int, env=None) -> dict:
    a = {"config": config, "world": world, "threads": threads, "vocab": args.vocab, "dim": args.dim,
         "layers": args.layers, "batch": args.batch, "seq": args.seq, "steps": args.steps,
         "warmup": args.warmup, "path": args.path, "cpu_budget": args.cpu_budget,
         "bucket_bytes": args.bucket_bytes, "port": args.port + hash(config) % 1000}
    cmd = [python, os.path.abspath(__file__), "--worker", json.dumps(a)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=args.timeout)
    wall = time.perf_counter() - t0
    line = next((l for l in proc.stdout.splitlines()[::-1] if l.startswith("BENCH_RESULT ")), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        return {"error": f"exit code {proc.returncode}", "stderr_tail": tail, "wall_s": wall}
    out = summarize(json.loads(line[len("BENCH_RESULT "):]))
    out["wall_s"] = wall
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--path", help="directory on the disk that holds NVMe state (a temporary folder "
                                  "is made in it and removed)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--cpu-budget", type=lambda s: _bytes(s), default="64MiB")
    p.add_argument("--bucket-bytes", type=lambda s: _bytes(s), default="8MiB")
    p.add_argument("--configs", default="torch,zero_nvme,zero_cpu,deepspeed")
    p.add_argument("--deepspeed-python", default=None,
                   help="python of a venv with deepspeed 0.19.8 (and this repo's torch)")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="threads of the one-process torch baseline (default: cores / world, "
                        "the same as each ZeroMuon rank; bf16 matmuls ran slower on 2 threads "
                        "than on 1 on the 2-core test machine)")
    p.add_argument("--port", type=int, default=29600)
    p.add_argument("--timeout", type=int, default=1800)
    args = p.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    if not args.path or not os.path.isdir(args.path):
        print("bench_step: --path must be an existing directory", file=sys.stderr)
        return 2
    cores = os.cpu_count() or 1
    threads = max(1, cores // args.world)
    wanted = args.configs.split(",")
    tmp = tempfile.mkdtemp(prefix="bench_step_", dir=args.path)
    args.path = tmp
    results = {}
    try:
        if "torch" in wanted:
            results["torch_muon_w1"] = run_config(sys.executable, args, "torch_muon_w1", 1,
                                                  args.torch_threads or threads)
        if "zero_nvme" in wanted:
            results[f"zero_muon_w{args.world}_nvme"] = run_config(
                sys.executable, args, f"zero_muon_w{args.world}_nvme", args.world, threads)
        if "zero_cpu" in wanted:
            results[f"zero_muon_w{args.world}_cpu"] = run_config(
                sys.executable, args, f"zero_muon_w{args.world}_cpu", args.world, threads)
        if "deepspeed" in wanted:
            name = f"deepspeed_zero3_muon_nvme_w{args.world}"
            if args.deepspeed_python:
                results[name] = run_config(args.deepspeed_python, args, name, args.world, threads,
                                           env={"DS_ACCELERATOR": "cpu"})
            else:
                results[name] = {"skipped": "no --deepspeed-python given"}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base = results.get("torch_muon_w1", {})
    ratios = {}
    for name, r in results.items():
        if "step_s" in r and "step_s" in base and name != "torch_muon_w1":
            ratios[f"{name}_step_vs_torch_w1"] = r["step_s"] / base["step_s"]
            ratios[f"{name}_iteration_vs_torch_w1"] = r["iteration_s"] / base["iteration_s"]
    ds = results.get(f"deepspeed_zero3_muon_nvme_w{args.world}", {})
    zn = results.get(f"zero_muon_w{args.world}_nvme", {})
    if "step_s" in ds and "step_s" in zn:
        ratios["zero_muon_nvme_vs_deepspeed_iteration"] = zn["iteration_s"] / ds["iteration_s"]
        ratios["zero_muon_nvme_vs_deepspeed_step"] = zn["step_s"] / ds["step_s"]
    import torch
    report = {
        "settings": {k: getattr(args, k) for k in ("world", "steps", "warmup", "vocab", "dim", "layers",
                                                   "batch", "seq", "cpu_budget", "bucket_bytes")},
        "results": results, "ratios": ratios,
        "environment": {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpus": cores,
                        "threads_per_rank": threads, "torch_threads": args.torch_threads or threads, "torch": torch.__version__,
                        "platform": platform.platform(), "loadavg": os.getloadavg()},
        "notes": ["step_s: optimizer step only; DeepSpeed runs its Muon update inside backward "
                  "(at the accumulation boundary), so compare iteration_s too",
                  "disk bytes come from /proc/self/io over forward+backward+step"],
    }
    print(json.dumps(report, indent=2))
    return 0


def _bytes(s) -> int:
    from offload_engine.units import parse_bytes
    return parse_bytes(s)


if __name__ == "__main__":
    sys.exit(main())
