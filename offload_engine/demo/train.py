"""Train the demo model with FSDP2 + ZeroMuon across W real processes.

Each rank draws its batches from a shuffling sampler with state, applies dropout (its own
RNG) and follows an LR schedule; checkpoints save all three beside the model and the
optimizer (``extra=``, and the RNG states), so a resumed run continues bit for bit.

``launch(cfg)`` starts W processes (gloo on CPU, nccl on CUDA), each holding one FSDP2
shard of the model and one TieredStore of optimizer state under ``cfg.store_dir``. Rank 0
sends one record per step to the parent (loss bits, step time, bytes moved, hit rate), so
the parent can print progress, compare runs bit for bit, and kill the run (SIGKILL, a real
crash) after a given step.
"""

from __future__ import annotations

import math
import os
import queue
import signal
import struct
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import partial

import torch
import torch.multiprocessing as mp
from ..errors import OperationTimeoutError, ProcessFailedError


@dataclass
class TrainConfig:
    """One training run. Sizes in elements/tokens; paths are directories."""

    store_dir: str
    model: str = "small"
    world_size: int = 2
    steps: int = 60
    batch_size: int = 8          # sequences per rank per step
    seq_len: int = 64
    muon_lr: float = 0.02
    adamw_lr: float = 3e-3
    seed: int = 0
    cpu_budget: int | None = None    # bytes of pinned pool per rank; None: below the state,
    bucket_bytes: int | None = None  # so it streams (demo/pool.py); bytes per bucket
    clip_norm: float = 1.0
    dropout: float = 0.1         # draws from each rank's torch RNG: a resume must restore it
    warmup_steps: int = 5        # LR schedule: linear warm-up, then cosine decay to 10%
    data_batches: int = 16       # batch ids the sampler shuffles per epoch (per rank)
    checkpoint_dir: str | None = None
    checkpoint_steps: list[int] = field(default_factory=list)  # save after these steps
    resume: bool = False         # start from the latest checkpoint in checkpoint_dir
    kill_after: int | None = None  # the parent SIGKILLs the run once this step is reported
    #                                and the checkpoint is committed (it is written in the background)


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """The learning rate schedule (a factor of each group's base rate) after ``step`` steps:
    linear warm-up over ``cfg.warmup_steps``, then cosine decay to 10% at ``cfg.steps``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    done = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, done)))


def loss_bits(x: float) -> str:
    """The float32 bits of a loss as hex: equal strings mean bitwise-equal losses."""
    return struct.pack("<f", x).hex()


def _worker(rank: int, cfg: TrainConfig, rendezvous: str, out) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ..optim import ZeroMuon
    from .data import MarkovText, ShuffledBatches
    from .model import PRESETS, build_model
    from .pool import demo_pool

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.world_size))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{rendezvous}",
                            rank=rank, world_size=cfg.world_size)
    try:
        device = "cuda" if cuda else "cpu"
        mesh = init_device_mesh(device, (cfg.world_size,))
        model = build_model(cfg.model, seed=cfg.seed, dropout=cfg.dropout).to(device)
        torch.manual_seed(cfg.seed * 1000 + rank)  # dropout masks differ per rank
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        pool = demo_pool(cfg.model, cfg.world_size)
        store = {"nvme_paths": [os.path.join(cfg.store_dir, "state")],
                 "cpu_budget": cfg.cpu_budget or pool.cpu_budget,
                 "bucket_bytes": cfg.bucket_bytes or pool.bucket_bytes,
                 "io_threads": 4, "queue_depth": 4, "block_size": "2MiB", "prefetch_depth": 2}
        if cuda:
            store["gpu_budget"] = "256MiB"  # staging for buckets acquired on the GPU
        opt = ZeroMuon(model.named_parameters(), lr=cfg.muon_lr, weight_decay=0.1,
                       adamw={"lr": cfg.adamw_lr, "betas": (0.9, 0.95), "weight_decay": 0.01},
                       store=store)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, partial(lr_factor, cfg))
        sampler = ShuffledBatches(cfg.data_batches, rank, seed=cfg.seed)
        # what a resume needs besides model and optimizer (the RNG states are saved too)
        extra = {"scheduler": scheduler, "sampler": sampler}
        start = 0
        if cfg.resume:
            from ..checkpoint import load_checkpoint
            start = load_checkpoint(cfg.checkpoint_dir, model, opt, extra=extra)
        preset = PRESETS[cfg.model]
        data = MarkovText(preset.vocab_size, min(cfg.seq_len, preset.max_seq_len), seed=1234 + cfg.seed)
        pending = None  # a checkpoint being written while training goes on
        for step in range(start + 1, cfg.steps + 1):
            t0 = time.perf_counter()
            x, y = data.batch(sampler.next(), rank, cfg.batch_size)
            logits = model(x.to(device))
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.to(device).flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
            opt.step()
            opt.zero_grad()
            lr = opt.param_groups[0]["lr"]
            scheduler.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            mean = float(mean) / cfg.world_size
            st = opt.last_step_stats
            started, saved = step in cfg.checkpoint_steps, None
            if started:
                from ..checkpoint import save_checkpoint_async
                pending = save_checkpoint_async(cfg.checkpoint_dir, model, opt, step, extra=extra)
            elif pending is not None and pending.done():
                saved, pending = pending.wait(), None  # committed: report it once
            if rank == 0:
                out.put({"step": step, "loss": mean, "loss_bits": loss_bits(mean), "lr": lr,
                         "step_s": time.perf_counter() - t0, "opt_s": st.step_s,
                         "read": st.store_bytes_read.get("nvme", 0),
                         "written": st.store_bytes_written.get("nvme", 0),
                         "hits": st.store_hits, "misses": st.store_misses,
                         "io_wait_s": st.store_io_wait_s, "a2a_sent": st.a2a_bytes_sent,
                         "checkpoint_started": started, "checkpoint": saved})
        if pending is not None:
            pending.wait()
        opt.close()
        if rank == 0:
            out.put({"done": True})
    finally:
        dist.destroy_process_group()


def launch(cfg: TrainConfig, on_step=None, timeout_s: float = 900) -> dict:
    """Run ``cfg`` in W spawned processes; returns {"records": [...], "killed": bool}.

    ``on_step(record)`` is called in the parent for every step rank 0 reports.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    records, killed, done, committed = [], False, False, False
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(r, cfg, rendezvous, out), daemon=True)
                 for r in range(cfg.world_size)]
        _start_deaf_to_ctrl_c(procs)
        deadline = time.monotonic() + timeout_s
        try:
            while not done:
                try:
                    rec = out.get(timeout=1.0)
                except queue.Empty:
                    if any(p.exitcode not in (None, 0) for p in procs):
                        codes = [p.exitcode for p in procs]
                        raise ProcessFailedError(f"a training process failed (exit codes {codes})")
                    if time.monotonic() > deadline:
                        raise OperationTimeoutError(f"training did not finish in {timeout_s:.0f} s")
                    continue
                if rec.get("done"):
                    done = True
                    break
                records.append(rec)
                if on_step:
                    on_step(rec)
                committed = committed or bool(rec.get("checkpoint"))
                if cfg.kill_after is not None and rec["step"] >= cfg.kill_after and (
                        committed or not cfg.checkpoint_steps):  # never before the commit
                    for p in procs:
                        os.kill(p.pid, signal.SIGKILL)  # a real crash: no cleanup runs
                    killed = True
                    break
        except BaseException:  # Ctrl-C, a failure or a timeout: nothing left to wait for
            for p in procs:
                if p.is_alive():
                    p.kill()
            raise
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    return {"records": records, "killed": killed, "config": asdict(cfg)}


def _start_deaf_to_ctrl_c(procs) -> None:
    """Start ``procs`` ignoring SIGINT. A terminal's Ctrl-C goes to the whole process group:
    each child would print its own KeyboardInterrupt traceback from wherever it was
    (about 60 lines for two ranks). A spawned interpreter keeps an ignored SIGINT ignored,
    so the children leave Ctrl-C to the parent, which stops them (``launch``)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for p in procs:
            p.start()
    finally:
        signal.signal(signal.SIGINT, previous)
