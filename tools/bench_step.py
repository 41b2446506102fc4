#!/usr/bin/env python3
"""ZeroMuon's optimizer step with state on NVMe against the same step in memory and against
max(I/O time at the disk's fio bandwidth, compute time), for a ~200M-parameter model on
FSDP2 at world size 2 (JSON).

The model is a decoder: a 32000x768 embedding and output head (AdamW, by name) and 21
blocks of q/k/v/o and MLP matrices (Muon) with LayerNorms (AdamW): 198M parameters. W
processes (gloo on CPU, FSDP2 ``fully_shard`` per block and at the root) each hold two
ZeroMuon optimizers over the same parameters, with the same bucket size:

- ``nvme``: state homed on NVMe, a pinned pool of the step's working set plus room for the
  prefetch (4 MiB buckets, 16 read ahead; a fifth of the state or less, so most of it
  streams every step);
- ``cpu``: state resident in pinned memory (no disk at all).

Each measured iteration runs forward/backward and one optimizer's step, then
forward/backward and the other's (which goes first alternates), so both see the same
machine load and the NVMe step's write-behind lands during a forward/backward, as in
training. Per step and rank: wall time of ``step()``, the process's CPU seconds (all
threads: compute and I/O threads), NVMe bytes read and written per state array (counted at
the array's file I/O, checked against the store's counters and /proc/self/io), all_to_all
bytes, and time blocked on I/O and communication.

Derived, from medians of the measured steps (slowest rank: a step is synchronous):

- ``compute_s``: the in-memory step time;
- ``io_s``: NVMe bytes all ranks moved in one step / the bandwidth fio measures in the same
  run (50/50 read/write, O_DIRECT, the store's block size and queue depth:
  ``tools/bench_store.fio_mixed_gbps``); the ranks share one disk;
- ``ratio = nvme step / max(io_s, compute_s)``, goal <= 1.15; and ``nvme step / cpu step``;
- NVMe bytes per parameter per step for Muon momentum, Adam moments and masters: goal 8, 16
  and 8 (4 B read + 4 B written per fp32 element) when every bucket streams; the pinned pool
  keeps a few buckets cached across steps, so the measured figure is the goal times the
  fraction of the state that moved, which is also given.

Run twice: fp32 parameters (no masters), and bf16 parameters with ``master_weights=True``
(state and masters fp32). ``--rule muon`` (default) is ZeroMuon's own rule (Muon for hidden
matrices, AdamW for the rest); ``--rule adamw`` puts every parameter on AdamW. Optionally,
DeepSpeed on the same model, same data, for each masters setting (``--deepspeed-python``: a
venv with deepspeed 0.19.8 that sees this repo's torch; see docs/optimizer.md): with
``--rule muon`` ZeRO-3 with its Muon optimizer and NVMe optimizer offload, with ``--rule
adamw`` ZeRO-Infinity (AdamW, optimizer state and parameters offloaded to NVMe; the
configuration most users arrive from). bf16 runs enable DeepSpeed's bf16 (fp32 masters).
Each side reports step and whole-iteration (forward, backward, step) time, disk bytes per
rank and peak RSS per rank.

    python tools/bench_step.py --path /nvme/bench --world 2 --steps 5 --warmup 1
    python tools/bench_step.py --path /nvme/bench --dim 768 --layers 12 --rule adamw \\
        --deepspeed-python /work/dsvenv/bin/python        # ~134 M parameters, all-AdamW

Peak RSS per rank comes three ways: ``peak_rss_bytes`` (the whole process: setup, where
each rank builds the model whole before sharding, included), ``training_peak_rss_bytes``
(forward, backward and steps only: the peak is reset after setup, Linux's ``clear_refs``;
DeepSpeed's worker reports the same window), and ``nvme_alone``: one more run, 1 warm-up
and 1 step, of the NVMe optimizer without its in-memory twin, whose resident state the
alternating run holds too. ``nvme_alone``'s training peak is the figure to hold against
DeepSpeed's; ``--no-rss-alone`` skips that run, ``--rss-alone-only`` runs only it.

``--smoke`` runs the same code at tiny sizes (a 2-block model of width 64, one measured
step, 16 KiB buckets, an 8 MiB fio file) in seconds and prints the same JSON: the test
suite runs it (with ``--deepspeed-python`` where deepspeed is installed) so the tool
cannot rot. Its figures mean nothing. Exit code 1 when a run failed (its entry in
``results`` then holds ``error`` and the end of its stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))


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
    """This process's peak resident set (bytes; Linux reports KiB)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Start a new peak-RSS window (Linux: ``clear_refs`` 5 resets VmHWM to the current
    RSS), so that setup (a model built whole before sharding, say) does not count; False
    where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def window_peak_rss_bytes() -> int | None:
    """Peak RSS since the last ``reset_peak_rss`` (bytes): VmHWM, which, unlike
    ``ru_maxrss``, does not keep the peak of before the reset when a thread exits."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def use_muon_rule(rule: str):
    """ZeroMuon's ``use_muon_rule`` for ``--rule``: its default, or AdamW for every parameter."""
    from offload_engine.optim import default_use_muon
    return default_use_muon if rule == "muon" else (lambda name, param: False)


def _median(xs):
    return statistics.median(xs) if xs else None


def _kind(array: dict) -> str:
    """Which of the issue's three figures a state array (its JSON entry) counts toward."""
    return {"MOMENTUM": "muon_momentum", "MASTER": "masters"}.get(array["kind"], "adam_moments")


class ArrayBytes:
    """NVMe bytes each state array reads and writes, counted where its file I/O is issued
    (``FlatArray.read_into`` / ``write_from``): an independent split of the store's totals."""

    def __init__(self, store):
        self.read: dict[str, int] = {}
        self.written: dict[str, int] = {}
        for name, arr in store.arrays().items():
            flat = getattr(arr, "flat", None)
            if flat is None:
                continue
            self.read[name] = self.written[name] = 0
            self._wrap(flat, name, arr.itemsize)

    def _wrap(self, flat, name, itemsize):
        read_into, write_from = flat.read_into, flat.write_from

        def counted_read(start, stop, out, _n=name, **kw):
            self.read[_n] += (stop - start) * itemsize
            return read_into(start, stop, out, **kw)

        def counted_write(start, stop, src, _n=name, **kw):
            self.written[_n] += (stop - start) * itemsize
            return write_from(start, stop, src, **kw)

        flat.read_into, flat.write_from = counted_read, counted_write

    def take(self) -> dict:
        out = {n: {"read": self.read[n], "written": self.written[n]} for n in self.read}
        for n in self.read:
            self.read[n] = self.written[n] = 0
        return out


# -- one rank -------------------------------------------------------------------------------------------
def _rank_main(rank, world, a, out_prefix):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from offload_engine.optim import ZeroMuon
    from offload_engine.optim.pool_budget import working_buckets

    torch.set_num_threads(a["threads"])
    dist.init_process_group("gloo", init_method=f"file://{out_prefix}.rendezvous", rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    master = a["master"]
    model = build_model(a["vocab"], a["dim"], a["layers"])
    if master:
        model.to(torch.bfloat16)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    named = list(model.named_parameters())
    local_elems = sum(p.to_local().numel() for _, p in named)
    hyper = dict(lr=0.02, weight_decay=0.1, adamw=dict(lr=3e-4, weight_decay=0.01),
                 master_weights=master, use_muon_rule=use_muon_rule(a.get("rule", "muon")))
    B = a["bucket_bytes"]
    io = {"io_threads": a["io_threads"], "queue_depth": a["queue_depth"],
          "block_size": a["block_size"], "prefetch_depth": a["prefetch_depth"]}
    opt_cpu = ZeroMuon(named, **hyper, store={"default_home": "cpu", "bucket_bytes": B,
                                              "cpu_budget": 16 * local_elems + (64 << 20), **io})
    lay = opt_cpu.layout
    pool = (working_buckets(lay) + len(lay.short_tails()) + a["extra_buckets"]) * B
    opt_nvme = ZeroMuon(named, **hyper, store={
        "nvme_paths": [os.path.join(a["path"], f"master{int(master)}" + ("-alone" if a.get("alone") else ""))],
        "cpu_budget": pool,
        "bucket_bytes": B, **io})
    counter = ArrayBytes(opt_nvme.store)
    # --rss-alone's run: the NVMe optimizer only, for a peak RSS that is ours alone (the
    # in-memory twin was made for its layout and is closed before training)
    kinds = ("nvme",) if a.get("alone") else ("nvme", "cpu")
    if a.get("alone"):
        opt_cpu.close()

    # what each rank holds: parameters per kind, state bytes per array (no padding: exact)
    infos = opt_nvme.infos
    params = {"muon_momentum": sum(i.local_numel(rank) for i in infos if i.kind == "muon"),
              "adam_moments": sum(i.local_numel(rank) for i in infos if i.kind == "adamw"),
              "masters": sum(i.local_numel(rank) for i in infos if i.dtype != torch.float32)
              if master else 0}
    arrays = {opt_nvme.array_name(n): {"dtype": a.dtype.name, "numel": a.numel,
                                       "kind": a.key.kind.name,
                                       "bytes": a.numel * a.dtype.itemsize,
                                       "padding_bytes": lay.padding.get(n, 0) * a.dtype.itemsize}
              for n, a in opt_nvme.layout.arrays.items()}
    result = {"rank": rank, "params": sum(i.numel for i in infos),
              "muon_params": sum(i.numel for i in infos if i.kind == "muon"),
              "local_params": params, "arrays": arrays, "pool_bytes": pool,
              "working_buckets": working_buckets(lay), "kept_tails": len(opt_nvme._pinned),
              "state_bytes": lay.state_bytes(), "bundles": len(lay.bundles),
              "shared_buckets": sum(1 for n in lay.uses().values() if n > 1)}

    gen = torch.Generator().manual_seed(1000 + rank)
    tokens = lambda: torch.randint(0, a["vocab"], (a["batch"], a["seq"] + 1), generator=gen)
    steps = {"nvme": [], "cpu": []}
    opts = {"nvme": opt_nvme, "cpu": opt_cpu}
    result["peak_rss_before_training_bytes"] = peak_rss_bytes()
    result["peak_window_reset"] = reset_peak_rss()
    for it in range(a["warmup"] + a["steps"]):
        order = kinds if it % 2 == 0 else kinds[::-1]
        for which in order:
            opt = opts[which]
            t0 = time.perf_counter()
            loss_of(model, tokens()).backward()
            t1 = time.perf_counter()
            io0, c0 = proc_io(), time.process_time()
            opt.step()
            t2 = time.perf_counter()
            c1, io1 = time.process_time(), proc_io()
            opt.zero_grad()
            st = opt.last_step_stats
            rec = {"iteration": it, "first": which == order[0], "fwd_bwd_s": t1 - t0,
                   "step_s": t2 - t1, "cpu_s": c1 - c0, "store_io_wait_s": st.store_io_wait_s,
                   "comm_wait_s": st.comm_wait_s, "ns_s": st.ns_s, "a2a_bytes_sent": st.a2a_bytes_sent,
                   "a2a_bytes_received": st.a2a_bytes_received, "a2a_calls": st.a2a_calls}
            if which == "nvme":
                # window: since the previous NVMe step ended (its write-behind included)
                rec["arrays"] = counter.take()
                rec["store_read"] = st.store_bytes_read["nvme"]
                rec["store_written"] = st.store_bytes_written["nvme"]
                rec["disk_read_in_step"] = io1[0] - io0[0]
                rec["disk_written_in_step"] = io1[1] - io0[1]
            if it >= a["warmup"]:
                steps[which].append(rec)
    result["steps"] = steps
    # training only (forward, backward, steps); both optimizers' state when both ran (the
    # kernel's two peak counters may differ by a few hundred KiB: /proc sums exactly)
    result["training_peak_rss_bytes"] = window_peak_rss_bytes() if result["peak_window_reset"] else None
    result["peak_rss_bytes"] = peak_rss_bytes()   # the whole process: setup included
    result["loadavg_end"] = os.getloadavg()
    opt_nvme.close()
    if not a.get("alone"):
        opt_cpu.close()
    dist.destroy_process_group()
    with open(f"{out_prefix}.rank{rank}.json", "w") as f:
        json.dump(result, f)


def _spawn(a: dict, rank_main) -> list[dict]:
    """Run ``rank_main(rank, world, a, prefix)`` in ``a["world"]`` processes; each writes
    ``<prefix>.rank<r>.json``; returns them in rank order."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        prefix = os.path.join(d, "out")
        mp.spawn(rank_main, args=(a["world"], a, prefix), nprocs=a["world"], join=True)
        out = []
        for r in range(a["world"]):
            with open(f"{prefix}.rank{r}.json") as f:
                out.append(json.load(f))
    return out


# -- figures ------------------------------------------------------------------------------------------
def summarize(ranks: list[dict], fio_gbps: float) -> dict:
    med = lambda r, which, key: _median([s[key] for s in r["steps"][which]])
    nvme_s = max(med(r, "nvme", "step_s") for r in ranks)
    cpu_s = max(med(r, "cpu", "step_s") for r in ranks)
    # NVMe bytes per rank per step (median over steps), by array and by kind
    per_rank = []
    for r in ranks:
        ss = r["steps"]["nvme"]
        arrays = {}
        for name in r["arrays"]:
            rd = _median([s["arrays"][name]["read"] for s in ss])
            wr = _median([s["arrays"][name]["written"] for s in ss])
            arrays[name] = {"read": rd, "written": wr}
        kinds = {}
        for name, v in arrays.items():
            k = kinds.setdefault(_kind(r["arrays"][name]), {"read": 0, "written": 0, "state_bytes": 0})
            k["read"] += v["read"]
            k["written"] += v["written"]
            k["state_bytes"] += r["arrays"][name]["bytes"]
        per_param = {}
        for k, v in kinds.items():
            n = r["local_params"].get(k) or 0
            if not n:
                continue
            per_param[k] = {
                "params_on_rank": n,
                "state_bytes_per_param": v["state_bytes"] / n,
                "nvme_bytes_per_param_per_step": (v["read"] + v["written"]) / n,
                "moved_fraction_of_state": v["read"] / v["state_bytes"],
                "if_every_bucket_streamed": 2 * v["state_bytes"] / n,
            }
        moved = sum(v["read"] + v["written"] for v in arrays.values())
        per_rank.append({
            "rank": r["rank"], "moved_bytes": moved, "arrays": arrays, "bytes_per_param": per_param,
            "store_counters_read_written": [_median([s["store_read"] for s in ss]),
                                            _median([s["store_written"] for s in ss])],
            "proc_io_read_written_during_step": [_median([s["disk_read_in_step"] for s in ss]),
                                                 _median([s["disk_written_in_step"] for s in ss])],
            "state_bytes": r["state_bytes"], "padding_bytes": sum(a["padding_bytes"]
                                                                  for a in r["arrays"].values()),
            "pool_bytes": r["pool_bytes"], "working_buckets": r["working_buckets"],
            "kept_tails": r["kept_tails"], "bundles": r["bundles"], "shared_buckets": r["shared_buckets"],
            "a2a_bytes_sent": med(r, "nvme", "a2a_bytes_sent"),
            "a2a_bytes_received": med(r, "nvme", "a2a_bytes_received"),
            "a2a_calls": med(r, "nvme", "a2a_calls"),
            "nvme": {k: med(r, "nvme", k) for k in ("step_s", "cpu_s", "store_io_wait_s",
                                                   "comm_wait_s", "ns_s", "fwd_bwd_s")},
            "cpu": {k: med(r, "cpu", k) for k in ("step_s", "cpu_s", "store_io_wait_s",
                                                  "comm_wait_s", "ns_s", "fwd_bwd_s")},
            "step_s_runs": {"nvme": [s["step_s"] for s in ss],
                            "cpu": [s["step_s"] for s in r["steps"]["cpu"]]},
        })
    io_bytes = sum(p["moved_bytes"] for p in per_rank)   # the ranks share the disk
    io_s = io_bytes / (fio_gbps * 1e9)
    bound = max(io_s, cpu_s)
    w = len(ranks)
    muon = ranks[0]["muon_params"]
    iteration = lambda which: max(_median([s["step_s"] + s["fwd_bwd_s"] for s in r["steps"][which]])
                                  for r in ranks)
    return {
        "params": ranks[0]["params"], "muon_params": muon, "world": w,
        "nvme_step_s": nvme_s, "cpu_step_s": cpu_s, "compute_s": cpu_s,
        "nvme_iteration_s": iteration("nvme"), "cpu_iteration_s": iteration("cpu"),
        "peak_rss_bytes_per_rank": [r.get("peak_rss_bytes") for r in ranks],
        "training_peak_rss_bytes_per_rank": [r.get("training_peak_rss_bytes") for r in ranks],
        "moved_bytes_per_rank": [p["moved_bytes"] for p in per_rank],
        "io_bytes_per_step_all_ranks": io_bytes, "io_s": io_s,
        "bound_s": bound, "bound_is": "io" if io_s > cpu_s else "compute",
        "ratio_nvme_over_bound": nvme_s / bound, "goal_ratio": 1.15,
        "ratio_nvme_over_cpu": nvme_s / cpu_s,
        "a2a_formula_bytes": 4 * (w - 1) / w * muon / w,
        "per_rank": per_rank,
    }


# -- the driver ---------------------------------------------------------------------------------------
def run_group(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int | None, str, str]:
    """Run ``cmd`` in a session of its own: (exit code, stdout, stderr); exit code None when
    it ran past ``timeout`` seconds, and then the whole session (its ranks, a DeepSpeed
    op build) is killed, not only the process we started."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err
    return proc.returncode, out, err


def worker_result(rc: int | None, out: str, err: str, timeout: float) -> dict:
    """The worker's ``BENCH_RESULT`` object, or ``{"error", "stderr_tail"}``. A worker that
    printed its figures and then died on its way out (DeepSpeed's AIO threads abort at
    interpreter exit: SIGABRT) keeps them, with ``exit_after_result`` saying how it ended."""
    line = next((l for l in out.splitlines()[::-1] if l.startswith("BENCH_RESULT ")), None)
    if rc is not None and rc != 0 and line is not None:
        return {**json.loads(line[len("BENCH_RESULT "):]), "exit_after_result": {
            "exit_code": rc, "stderr_tail": (err or "").strip().splitlines()[-5:]}}
    if rc != 0 or line is None:
        why = f"timed out after {timeout} s" if rc is None else f"exit code {rc}"
        return {"error": why, "stderr_tail": (err or out).strip().splitlines()[-20:]}
    return json.loads(line[len("BENCH_RESULT "):])


def run_worker(args, master: bool, alone: bool = False) -> dict:
    """One run of ours (a fresh interpreter, ``args.world`` ranks): both optimizers
    alternating, or with ``alone`` the NVMe one only, 1 warm-up and 1 measured step (for
    its peak RSS)."""
    a = {"alone": alone, "world": args.world, "threads": args.threads, "master": master, "rule": args.rule,
         "vocab": args.vocab,
         "dim": args.dim, "layers": args.layers, "batch": args.batch, "seq": args.seq,
         "steps": args.steps, "warmup": args.warmup, "path": args.path,
         "bucket_bytes": args.bucket_bytes, "extra_buckets": args.extra_buckets,
         "io_threads": args.io_threads, "queue_depth": args.queue_depth,
         "block_size": args.block_size, "prefetch_depth": args.prefetch_depth}
    if alone:
        a.update(steps=1, warmup=1)
    return run_tool_worker(os.path.abspath(__file__), a, args.timeout)


def alone_memory(raw: dict) -> dict:
    """Peak RSS per rank of ``run_worker(..., alone=True)``: the figure to hold against a
    peer's (the alternating run's also holds the in-memory twin's state)."""
    if "error" in raw:
        return raw
    return {"training_peak_rss_bytes_per_rank": [r.get("training_peak_rss_bytes") for r in raw["ranks"]],
            "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in raw["ranks"]],
            "wall_s": raw["wall_s"]}


def run_tool_worker(script: str, a: dict, timeout: float, python: str = sys.executable,
                    env: dict | None = None) -> dict:
    """``python script --worker <a as JSON>`` in a session of its own: the worker's result
    with ``wall_s`` (seconds), or ``{"error", "stderr_tail"}``."""
    t0 = time.perf_counter()
    out = worker_result(*run_group([python, script, "--worker", json.dumps(a)], timeout, env),
                        timeout)
    if "error" not in out:
        out["wall_s"] = time.perf_counter() - t0
    return out


# --smoke: the sizes it sets (everything else as given)
# (about 150k parameters; 16 KiB buckets and a pool of a few of them, so the state streams)
SMOKE = {"steps": 1, "warmup": 1, "vocab": 256, "dim": 64, "layers": 2, "batch": 1, "seq": 8,
         "bucket_bytes": 16 << 10, "extra_buckets": 2, "io_threads": 2, "queue_depth": 2,
         "block_size": 16 << 10, "prefetch_depth": 2, "fio_size": 8 << 20, "fio_runs": 1,
         "threads": 1, "timeout": 300}


def main(argv=None) -> int:
    from offload_engine.units import parse_bytes
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--path", help="directory on the NVMe (a temporary folder is made in it and removed)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="measured steps of each kind (median)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=21)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: cores / W)")
    p.add_argument("--bucket-bytes", type=parse_bytes, default=parse_bytes("4MiB"))
    p.add_argument("--extra-buckets", type=int, default=16,
                   help="pinned pool = the step's working set + the arrays' short tails + this "
                        "(room for the prefetch)")
    p.add_argument("--io-threads", type=int, default=8)
    p.add_argument("--queue-depth", type=int, default=8)
    p.add_argument("--block-size", type=parse_bytes, default=parse_bytes("4MiB"))
    p.add_argument("--prefetch-depth", type=int, default=16,
                   help="buckets read ahead (16 x 4 MiB: 64 MiB ahead)")
    p.add_argument("--fio-size", type=parse_bytes, default=parse_bytes("1GiB"))
    p.add_argument("--fio-runs", type=int, default=3)
    p.add_argument("--masters", choices=("both", "off", "on"), default="both",
                   help="fp32 parameters without masters, bf16 parameters with fp32 masters, or both")
    p.add_argument("--rule", choices=("muon", "adamw"), default="muon",
                   help="muon: ZeroMuon's rule (Muon for hidden matrices); adamw: every parameter "
                        "on AdamW (DeepSpeed's side then runs ZeRO-Infinity AdamW)")
    p.add_argument("--deepspeed-python", default=None,
                   help="also run DeepSpeed on the same model with this interpreter (a venv with "
                        "deepspeed 0.19.8 and this repo's torch): ZeRO-3 Muon with NVMe optimizer "
                        "offload (--rule muon) or ZeRO-Infinity AdamW (--rule adamw)")
    p.add_argument("--deepspeed-zero-init", action="store_true",
                   help="build DeepSpeed's model under deepspeed.zero.Init (each parameter "
                        "partitioned as it is made), as users of large models do: without it "
                        "every rank holds the whole model first (at 1 B parameters, fp32, W=2, "
                        "more than 23 GiB of RAM holds)")
    p.add_argument("--deepspeed-offload-params", choices=("nvme", "none"), default="nvme",
                   help="--rule adamw: DeepSpeed's parameters on NVMe too (ZeRO-Infinity, the "
                        "default) or in host memory (optimizer offload only, as ours)")
    p.add_argument("--no-rss-alone", dest="rss_alone", action="store_false",
                   help="skip the extra run (1 warm-up, 1 step) of the NVMe optimizer alone that "
                        "measures our peak RSS without the in-memory twin's state")
    p.add_argument("--rss-alone-only", action="store_true",
                   help="run only that NVMe-alone run (no fio, no in-memory twin, no DeepSpeed): "
                        "our peak RSS at a size in minutes")
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes, seconds, the same code and JSON (figures mean nothing)")
    args = p.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    if args.worker:
        a = json.loads(args.worker)
        ranks = _spawn(a, _ds_rank_main if a.get("deepspeed") else _rank_main)
        print("BENCH_RESULT " + json.dumps({"ranks": ranks}))
        return 0
    if not args.path or not os.path.isdir(args.path):
        print("bench_step: --path must be an existing directory", file=sys.stderr)
        return 2
    from bench_store import fio_mixed_gbps
    cores = os.cpu_count() or 1
    args.threads = args.threads or max(1, cores // args.world)
    load0 = os.getloadavg()
    tmp = tempfile.mkdtemp(prefix="bench_step_", dir=args.path)
    args.path = tmp
    results = {}
    try:
        fio = (None if args.rss_alone_only else
               fio_mixed_gbps(tmp, args.fio_size, args.block_size, args.queue_depth, args.fio_runs))
        for master in {"both": (False, True), "off": (False,), "on": (True,)}[args.masters]:
            name = "bf16_params_fp32_masters" if master else "fp32_params_no_masters"
            if args.rss_alone_only:
                results[name] = {"nvme_alone": alone_memory(run_worker(args, master, alone=True))}
                continue
            raw = run_worker(args, master)
            results[name] = raw if "error" in raw else {**summarize(raw["ranks"], fio["mixed"]["gbps"]),
                                                        "wall_s": raw["wall_s"]}
            if args.rss_alone and "error" not in raw:
                results[name]["nvme_alone"] = alone_memory(run_worker(args, master, alone=True))
            if args.deepspeed_python:
                ds = deepspeed_name(args.rule, master)
                results[ds] = run_deepspeed(args, master, zero_init=args.deepspeed_zero_init)
                if "error" not in results[ds] and "error" not in results[name]:
                    results[ds]["ours_over_deepspeed"] = {
                        "step": results[name]["nvme_step_s"] / results[ds]["step_s"],
                        "iteration": results[name]["nvme_iteration_s"] / results[ds]["iteration_s"]}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    import torch
    report = {
        "settings": {k: getattr(args, k) for k in (
            "world", "rule", "steps", "warmup", "vocab", "dim", "layers", "batch", "seq", "threads",
            "bucket_bytes", "extra_buckets", "io_threads", "queue_depth", "block_size",
            "prefetch_depth", "deepspeed_zero_init", "deepspeed_offload_params", "rss_alone", "rss_alone_only")},
        "fio": fio, "results": results,
        "environment": {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpus": cores,
                        "torch": torch.__version__, "platform": platform.platform(),
                        "loadavg_before": load0, "loadavg_after": os.getloadavg()},
        "notes": [
            f"{args.world} ranks x {args.threads} torch thread(s) on {cores} cores; each NVMe store "
            f"also runs {args.io_threads} I/O threads, which compete with Newton-Schulz and "
            "gloo for the same cores (cpu_s: the process's CPU seconds per step, all threads)",
            "io_s: bytes both ranks moved per step / fio's 50/50 O_DIRECT read+write rate on "
            "the same disk, same block size and queue depth",
            "compute_s: the same step with the state in pinned memory (median, slowest rank)",
            "bytes per parameter: fp32 state is 4 B per element, so one read and one write of "
            "every bucket is 8 B (Muon momentum, masters) or 16 B (Adam moments); the pinned "
            "pool keeps some buckets across steps: measured = if_every_bucket_streamed x "
            "moved_fraction_of_state",
        ],
    }
    print(json.dumps(report, indent=2))
    # a DeepSpeed run that fails (at 987 M fp32 the kernel kills it for memory) is a figure
    # of the peer, recorded with how it ended; only our own runs failing fail the tool
    ours = [r for name, r in results.items() if not name.startswith("deepspeed")]
    return 1 if any("error" in r or "error" in r.get("nvme_alone", {}) for r in ours) else 0


def deepspeed_name(rule: str, master: bool) -> str:
    """The ``results`` key of DeepSpeed's run for a rule and a masters setting."""
    base = "deepspeed_zero3_muon_nvme" if rule == "muon" else "deepspeed_zero_infinity_adamw_nvme"
    return base + ("_bf16" if master else "")


def deepspeed_worker_args(args, master: bool) -> dict:
    """What one DeepSpeed run needs (``_ds_rank_main``'s ``a``); bench_train_large builds
    the same dict for its peer."""
    return {"deepspeed": True, "world": args.world, "threads": args.threads, "vocab": args.vocab,
            "dim": args.dim, "layers": args.layers, "batch": args.batch, "seq": args.seq,
            "steps": args.steps, "warmup": args.warmup, "path": args.path, "rule": args.rule,
            "bf16": master, "bucket_bytes": args.bucket_bytes, "port": 29600 + os.getpid() % 1000,
            "offload_params": getattr(args, "deepspeed_offload_params", "nvme")}


def run_deepspeed(args, master: bool = False, script: str | None = None,
                  zero_init: bool = False) -> dict:
    """DeepSpeed's run in its own interpreter (``args.deepspeed_python``): its medians, or
    ``{"error", "stderr_tail"}`` with the exit code and the end of its output. ``zero_init``
    builds the model under ``deepspeed.zero.Init`` (partitioned as it is made)."""
    a = {**deepspeed_worker_args(args, master), "zero_init": zero_init}
    out = run_tool_worker(script or os.path.abspath(__file__), a,
                          args.timeout, args.deepspeed_python,
                          {**os.environ, "DS_ACCELERATOR": "cpu"})
    if "error" in out:
        return out
    ranks = out["ranks"]
    med = lambda r, k: _median([s[k] for s in r["steps"]])
    return {"config": ranks[0]["config"],
            "step_s": max(med(r, "step_s") for r in ranks),
            "iteration_s": max(med(r, "step_s") + med(r, "fwd_bwd_s") for r in ranks),
            "disk_read_bytes_per_step": [med(r, "disk_read") for r in ranks],
            "disk_write_bytes_per_step": [med(r, "disk_write") for r in ranks],
            "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in ranks],
            "training_peak_rss_bytes_per_rank": [r.get("training_peak_rss_bytes") for r in ranks],
            "step_s_runs": [[s["step_s"] for s in r["steps"]] for r in ranks],
            "note": "DeepSpeed orthogonalizes inside backward at the accumulation boundary: "
                    "compare iteration_s too; disk bytes per rank from /proc/self/io, the "
                    "whole iteration (parameter swaps included)",
            **({"exit_after_result": out["exit_after_result"]} if "exit_after_result" in out else {})}


def deepspeed_config(a: dict, nvme: str) -> dict:
    """ZeRO-3 with NVMe optimizer offload: DeepSpeed's Muon (``rule`` muon), or ZeRO-Infinity
    AdamW (``rule`` adamw: parameters on NVMe too, unless ``offload_params`` is "none": then
    they stay in host memory, as ZeroMuon's do); bf16 with fp32 masters when ``bf16``."""
    zero = {"stage": 3, "sub_group_size": a["bucket_bytes"] // 4,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": False,
                                  "buffer_count": 4}}
    if a.get("rule", "muon") == "muon":
        optimizer = {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1,
                                                "adam_lr": 3e-4, "adam_weight_decay": 0.01}}
        # DeepSpeed refuses Muon with reduce_scatter (stage3.py): its Muon path all-reduces
        zero["reduce_scatter"] = False
    else:
        optimizer = {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}}
        if a.get("offload_params", "nvme") == "nvme":
            zero["offload_param"] = {"device": "nvme", "nvme_path": nvme, "pin_memory": False}
    cfg = {"train_micro_batch_size_per_gpu": a["batch"], "gradient_accumulation_steps": 1,
           "optimizer": optimizer, "zero_optimization": zero,
           "aio": {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1,
                   "single_submit": False, "overlap_events": True},
           "wall_clock_breakdown": False, "steps_per_print": 10 ** 9}
    if a.get("bf16"):
        cfg["bf16"] = {"enabled": True}
    return cfg


def _ds_rank_main(rank, world, a, out_prefix):
    """DeepSpeed ZeRO-3 with optimizer state offloaded to NVMe (``deepspeed_config``)."""
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a["port"]),
                      RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    import contextlib
    import torch
    import deepspeed
    from offload_engine.optim import use_muon_for
    torch.set_num_threads(a["threads"])
    deepspeed.init_distributed(dist_backend="gloo")
    nvme = os.path.join(a["path"], "deepspeed")
    os.makedirs(nvme, exist_ok=True)
    ds_cfg = deepspeed_config(a, nvme)
    # zero_init: each parameter partitioned as it is made, as a model larger than RAM needs
    # (bench_train_large); a partitioned parameter keeps its real shape in ds_shape
    building = (deepspeed.zero.Init(config_dict_or_path=ds_cfg) if a.get("zero_init")
                else contextlib.nullcontext())
    with building:
        model = build_model(a["vocab"], a["dim"], a["layers"])
    if a.get("rule", "muon") == "muon":
        for n, p in model.named_parameters():
            p.use_muon = use_muon_for(n, len(getattr(p, "ds_shape", p.shape)))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_cfg)
    gen = torch.Generator().manual_seed(1000 + rank)
    steps = []
    windowed = reset_peak_rss()
    for i in range(a["warmup"] + a["steps"]):
        tokens = torch.randint(0, a["vocab"], (a["batch"], a["seq"] + 1), generator=gen)
        io0 = proc_io()
        t0 = time.perf_counter()
        engine.backward(loss_of(engine, tokens))
        t1 = time.perf_counter()
        engine.step()
        t2 = time.perf_counter()
        io1 = proc_io()
        if i >= a["warmup"]:
            steps.append({"fwd_bwd_s": t1 - t0, "step_s": t2 - t1,
                          "disk_read": io1[0] - io0[0], "disk_write": io1[1] - io0[1]})
    window = window_peak_rss_bytes() if windowed else None
    with open(f"{out_prefix}.rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "steps": steps, "peak_rss_bytes": peak_rss_bytes(),
                   "training_peak_rss_bytes": window, "config": ds_cfg}, f)


if __name__ == "__main__":
    sys.exit(main())
