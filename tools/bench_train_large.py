#!/usr/bin/env python3
"""Training whose optimizer state does not fit in host memory: a few real steps of a large
decoder with ZeroMuon's state on NVMe, against its bound and against DeepSpeed (JSON).

The model is bench_step's decoder (``build_model``: an embedding and an untied output head
of vocab x hidden, ``--layers`` blocks of q/k/v/o and 4x MLP matrices, LayerNorms), about
``--params`` parameters (3e9 by default; ``--hidden``/``--layers`` pin the shape), built in
bf16. ZeroMuon runs with ``master_weights=True``: fp32 masters, Muon momentum and Adam
moments are all homed on NVMe (``--path``) behind a pinned pool of ``--pool`` bytes, at
``--world`` 1 (plain tensors) or 2 (FSDP2 over gloo). ``--rule adamw`` puts every parameter
on AdamW (I/O-bound: the regime that shows the engine), ``--rule muon`` is ZeroMuon's own
rule (Newton-Schulz: compute-bound on a CPU). Each step is a forward and backward on random
tokens, then ``step()``. Per measured step and rank: step and forward/backward time, time
blocked on the store, NVMe bytes read and written (the store's counters, and
/proc/self/io), resident memory.

Reported against:

- ``compute_only``: the same model with the state in memory, which does not fit at full
  size; so the same code runs with the state homed in host memory on ``--probe-layers``
  (two layer counts, default 1 and 2: each block has the same shapes, so time is linear in
  blocks) and the step and iteration times are extrapolated to ``--layers``; a probe at or
  above the real layer count is the model itself;
- ``formula``: state bytes moved per rank per step when every bucket streams once each
  way, docs/optimizer.md: 8 B per parameter of masters, 8 of Muon momentum, 16 of Adam
  moments (fp32, read and written);
- ``fio``: a 50/50 sequential O_DIRECT read/write mix at the store's block size and queue
  depth on the same disk in the same run (``bench_store.fio_mixed_gbps``), so the I/O bound
  is the bytes all ranks moved / that rate; skipped, with why, when fio is missing;
- ``bound = max(compute-only step, I/O time)``; the goal is step <= 1.10x the bound;
- peak RSS of each rank against the machine's RAM, and the state's bytes against RAM.

``--peer deepspeed`` then runs DeepSpeed ZeRO-3 with NVMe optimizer offload on the same
model and data in its own interpreter (``--deepspeed-python``, default
``$OFFLOAD_ENGINE_DEEPSPEED_PYTHON``): its Muon (MuonWithAuxAdam) for ``--rule muon``,
its AdamW for ``--rule adamw``, bf16 with fp32 masters, the model built under
``deepspeed.zero.Init`` (partitioned as it is made, as DeepSpeed asks of models this
large), bench_step's DeepSpeed worker. Its parameters stay in host memory, as ZeroMuon's
do; ``--deepspeed-offload-params nvme`` puts them on NVMe too (ZeRO-Infinity), which at
3 B on this machine stops in the first forward ("Not enough buffers 0 for swapping 1",
its parameter swapper; docs/benchmarks.md). Its figures, or exactly how it failed (exit
code, last lines of its output).

    python tools/bench_train_large.py --path /nvme/bench --params 3e9 --rule adamw --steps 3
    python tools/bench_train_large.py --path /nvme/bench --params 3e9 --state-over-ram 1.1 --rule muon \\
        --steps 1 --peer deepspeed --deepspeed-python /work/dsvenv/bin/python

``--state-over-ram R`` grows the model past ``--params`` where needed for the rule's state to
be at least R times this machine's RAM (under the Muon rule a parameter's state is 8 B, not
12, so the same state takes a larger model: 3.4 B parameters for 1.1x of 25.3 GB).

``--smoke`` runs the same code at tiny sizes in seconds (figures mean nothing): the test
suite runs it. Exit code 1 when a run failed (its entry holds ``error``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import types

TOOLS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TOOLS)
sys.path.insert(0, ROOT)
sys.path.insert(0, TOOLS)

from bench_step import (_spawn, build_model, loss_of, peak_rss_bytes, proc_io,  # noqa: E402
                        run_deepspeed, run_tool_worker, use_muon_rule)

DEEPSPEED_PYTHON_ENV = "OFFLOAD_ENGINE_DEEPSPEED_PYTHON"
GOAL_STEP_OVER_BOUND = 1.10
# --smoke: the sizes it sets (everything else as given)
SMOKE = {"vocab": 256, "hidden": 64, "layers": 3, "probe_layers": [1, 2], "steps": 1,
         "warmup": 1, "batch": 1, "seq": 8, "bucket_bytes": 16 << 10, "pool": 512 << 10,
         "block_size": 16 << 10, "queue_depth": 2, "io_threads": 2, "fio_size": 8 << 20,
         "fio_runs": 1, "timeout": 300}


def decoder_params(vocab: int, hidden: int, layers: int) -> int:
    """Parameters (elements) of ``build_model(vocab, hidden, layers)``."""
    return 2 * vocab * hidden + layers * (12 * hidden * hidden + 4 * hidden) + 2 * hidden


def shape_for(params: float, vocab: int) -> tuple[int, int]:
    """(hidden, layers) of about ``params`` parameters: hidden a multiple of 256, about 128
    elements of width per block of depth (Llama's 3 B: 3072 wide, 28 deep)."""
    best = None
    for hidden in range(256, 16385, 256):
        per_block = 12 * hidden * hidden + 4 * hidden
        layers = round((params - 2 * vocab * hidden - 2 * hidden) / per_block)
        if layers < 1:
            break
        score = abs(layers - hidden / 128)
        if best is None or score < best[0]:
            best = (score, hidden, layers)
    if best is None:
        raise SystemExit(f"bench_train_large: {params:.3g} parameters is below one block at "
                         f"vocab {vocab}; pass --hidden and --layers")
    return best[1], best[2]


def state_bytes_for(vocab: int, hidden: int, layers: int, rule: str) -> int:
    """Optimizer state (bytes) of the decoder with fp32 masters: 12 B per AdamW parameter
    (master + two moments), 8 B per Muon parameter (master + momentum); the Muon rule puts
    the blocks' matrices on Muon, embeddings, head and norms on AdamW."""
    params = decoder_params(vocab, hidden, layers)
    muon = layers * 12 * hidden * hidden if rule == "muon" else 0
    return 8 * muon + 12 * (params - muon)


def params_for_state(state_bytes: float, vocab: int, rule: str) -> float:
    """About how many parameters (``shape_for``'s input) make a state of at least
    ``state_bytes`` under ``rule`` (bisection: state grows with parameters)."""
    def state(params: float) -> int:
        return state_bytes_for(vocab, *shape_for(params, vocab), rule)
    low = high = 1e8   # shape_for's smallest shapes need some parameters to start from
    while state(high) < state_bytes:
        low, high = high, high * 2
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if state(mid) < state_bytes else (low, mid)
    return high


# -- one rank -----------------------------------------------------------------------------------
def _rank_main(rank, world, a, out_prefix):
    """Train ``a["steps"]`` measured steps (after ``a["warmup"]``) with the state homed on
    ``a["home"]`` ("nvme" or "cpu"); writes ``<prefix>.rank<r>.json``."""
    import torch
    import torch.distributed as dist
    from offload_engine.optim import ZeroMuon

    torch.set_num_threads(a["threads"])
    dist.init_process_group("gloo", init_method=f"file://{out_prefix}.rendezvous", rank=rank,
                            world_size=world)
    torch.set_default_dtype(torch.bfloat16)   # built in bf16: an fp32 copy would not fit
    if world == 1:
        model = build_model(a["vocab"], a["hidden"], a["layers"])
    else:
        model = build_sharded(a, world)
    torch.set_default_dtype(torch.float32)
    named = list(model.named_parameters())
    local = lambda p: p.to_local() if hasattr(p, "to_local") else p
    local_elems = sum(local(p).numel() for _, p in named)
    io = {"bucket_bytes": a["bucket_bytes"], "io_threads": a["io_threads"],
          "queue_depth": a["queue_depth"], "block_size": a["block_size"]}
    if a["home"] == "nvme":
        store = {"nvme_paths": [os.path.join(a["path"], "state")], "cpu_budget": a["pool"], **io}
    else:   # fp32 masters + at most two moments: 12 B per element, plus short buckets
        store = {"default_home": "cpu", "cpu_budget": 16 * local_elems + (64 << 20), **io}
    opt = ZeroMuon(named, lr=0.02, weight_decay=0.1, adamw=dict(lr=3e-4, weight_decay=0.01),
                   master_weights=True, use_muon_rule=use_muon_rule(a["rule"]), store=store)
    infos = opt.infos
    muon = sum(i.local_numel(rank) for i in infos if i.kind == "muon")
    adamw = sum(i.local_numel(rank) for i in infos if i.kind == "adamw")
    masters = sum(i.local_numel(rank) for i in infos if i.dtype != torch.float32)
    result = {"rank": rank, "params": sum(i.numel for i in infos),
              "local_params": {"muon": muon, "adamw": adamw, "masters": masters},
              # one read and one write of every fp32 element (docs/optimizer.md)
              "formula_bytes_per_step": 8 * muon + 16 * adamw + 8 * masters,
              "state_bytes": opt.layout.state_bytes(), "rss_after_build_bytes": peak_rss_bytes()}
    gen = torch.Generator().manual_seed(1000 + rank)
    steps = []
    for it in range(a["warmup"] + a["steps"]):
        tokens = torch.randint(0, a["vocab"], (a["batch"], a["seq"] + 1), generator=gen)
        t0 = time.perf_counter()
        loss = loss_of(model, tokens)
        loss.backward()
        t1 = time.perf_counter()
        io0 = proc_io()
        opt.step()
        t2 = time.perf_counter()
        io1 = proc_io()
        opt.zero_grad(set_to_none=True)
        st = opt.last_step_stats
        if it >= a["warmup"]:
            steps.append({"loss": loss.item(), "fwd_bwd_s": t1 - t0, "step_s": t2 - t1,
                          "store_io_wait_s": st.store_io_wait_s, "ns_s": st.ns_s,
                          "comm_wait_s": st.comm_wait_s,
                          "nvme_read": st.store_bytes_read.get("nvme", 0),
                          "nvme_written": st.store_bytes_written.get("nvme", 0),
                          "disk_read_in_step": io1[0] - io0[0],
                          "disk_written_in_step": io1[1] - io0[1]})
    result["steps"] = steps
    result["peak_rss_bytes"] = peak_rss_bytes()
    opt.close()
    dist.destroy_process_group()
    with open(f"{out_prefix}.rank{rank}.json", "w") as f:
        json.dump(result, f)


def build_sharded(a: dict, world: int):
    """The model under FSDP2 (a block per unit, and the root) without ever holding it whole:
    made on the meta device, sharded, then each rank's shards allocated and filled (normal
    0.02, norms 1 and 0: GPT-2's initialization; values do not change the step's cost)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    with torch.device("meta"):
        model = build_model(a["vocab"], a["hidden"], a["layers"])
    mesh = init_device_mesh("cpu", (world,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(int(torch.distributed.get_rank()))
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local()
            if "norm" in name:
                local.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                local.normal_(0.0, 0.02, generator=gen)
    return model


def run_ranks(args, home: str, layers: int) -> dict:
    """One run (a fresh interpreter, ``args.world`` ranks) of ``layers`` blocks with the state
    on ``home``: ``{"ranks": [...]}`` or ``{"error", "stderr_tail"}``."""
    a = {k: getattr(args, k) for k in ("world", "threads", "vocab", "hidden", "rule", "batch",
                                       "seq", "steps", "warmup", "path", "pool", "bucket_bytes",
                                       "io_threads", "queue_depth", "block_size")}
    a.update(home=home, layers=layers)
    return run_tool_worker(os.path.abspath(__file__), a, args.timeout)


# -- figures ------------------------------------------------------------------------------------
def _med(rank: dict, key: str) -> float:
    return statistics.median(s[key] for s in rank["steps"])


def slowest(ranks: list[dict], key) -> float:
    """The slowest rank's median of ``key`` (a step is synchronous)."""
    get = key if callable(key) else (lambda s: s[key])
    return max(statistics.median(get(s) for s in r["steps"]) for r in ranks)


def extrapolate(probes: dict[int, float], params: dict[int, int], layers: int,
                total: int) -> tuple[float, str]:
    """The value at ``layers`` blocks from probes {blocks: seconds} and their parameter counts
    (``params``; ``total`` at ``layers``), and how: the probe itself when one is at
    ``layers``; else the line through two probes (time is linear in blocks of one shape);
    where noise makes that line fall, the larger probe scaled by parameters."""
    if layers in probes:
        return probes[layers], "measured at the model's own layer count"
    (l1, t1), (l2, t2) = sorted(probes.items())[:2]
    if t2 > t1:
        return t1 + (t2 - t1) / (l2 - l1) * (layers - l1), "linear in blocks through the two probes"
    return t2 * total / params[l2], (f"scaled by parameters from the {l2}-block probe (the probes "
                                     f"did not grow with blocks: {t1:.3f} s, {t2:.3f} s; noise)")


def compute_only(args) -> dict:
    """The in-memory step and iteration at ``args.layers`` blocks, from probes: per probe the
    fastest measured step of the slowest rank (compute does not get faster by chance; other
    work on the machine only slows it)."""
    probes = sorted({min(n, args.layers) for n in args.probe_layers})
    if len(probes) < 2 and args.layers not in probes:
        return {"error": f"--probe-layers needs two layer counts below {args.layers}"}
    step, iteration, params, runs = {}, {}, {}, {}
    fastest = lambda ranks, key: max(min(key(s) for s in r["steps"]) for r in ranks)
    for n in probes:
        out = run_ranks(args, "cpu", n)
        if "error" in out:
            return {"error": f"probe at {n} layers: {out['error']}", "stderr_tail": out["stderr_tail"]}
        ranks = out["ranks"]
        step[n] = fastest(ranks, lambda s: s["step_s"])
        iteration[n] = fastest(ranks, lambda s: s["step_s"] + s["fwd_bwd_s"])
        params[n] = ranks[0]["params"]
        runs[n] = {"params": params[n], "step_s": step[n], "iteration_s": iteration[n],
                   "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks)}
    total = decoder_params(args.vocab, args.hidden, args.layers)
    step_s, how = extrapolate(step, params, args.layers, total)
    iteration_s, how_iteration = extrapolate(iteration, params, args.layers, total)
    return {"step_s": step_s, "iteration_s": iteration_s, "probes": runs,
            "method": f"state homed in host memory; step: {how}; iteration: {how_iteration}"}


def summarize(ranks: list[dict], compute: dict, fio_gbps: float | None, ram: int) -> dict:
    """Step, bytes, bound and memory figures of the NVMe run."""
    step_s = slowest(ranks, "step_s")
    iteration_s = slowest(ranks, lambda s: s["step_s"] + s["fwd_bwd_s"])
    moved = [statistics.median(s["nvme_read"] + s["nvme_written"] for s in r["steps"]) for r in ranks]
    formula = [r["formula_bytes_per_step"] for r in ranks]
    io_s = sum(moved) / (fio_gbps * 1e9) if fio_gbps else None   # the ranks share one disk
    c_step = compute.get("step_s")
    bound = max(c_step, io_s) if c_step is not None and io_s is not None else None
    state = sum(r["state_bytes"] for r in ranks)
    peak = [r["peak_rss_bytes"] for r in ranks]
    return {
        "params": ranks[0]["params"], "world": len(ranks),
        "step_s": step_s, "iteration_s": iteration_s,
        "fwd_bwd_s": slowest(ranks, "fwd_bwd_s"),
        "store_io_wait_s": slowest(ranks, "store_io_wait_s"), "ns_s": slowest(ranks, "ns_s"),
        "step_s_runs": [[s["step_s"] for s in r["steps"]] for r in ranks],
        "losses": [s["loss"] for s in ranks[0]["steps"]],
        "compute_only_step_s": c_step, "compute_only_iteration_s": compute.get("iteration_s"),
        "bytes_moved_per_rank": moved, "formula_bytes_per_rank": formula,
        "moved_over_formula": [m / f if f else None for m, f in zip(moved, formula)],
        "proc_io_read_written_per_rank": [[_med(r, "disk_read_in_step"), _med(r, "disk_written_in_step")]
                                          for r in ranks],
        "io_s": io_s, "bound_s": bound,
        "bound_is": None if bound is None else ("io" if io_s > c_step else "compute"),
        "step_over_bound": step_s / bound if bound else None,
        "goal_step_over_bound": GOAL_STEP_OVER_BOUND,
        "iteration_over_bound": (iteration_s / max(compute["iteration_s"], io_s)
                                 if bound else None),
        "state_bytes": state, "ram_bytes": ram, "state_over_ram": state / ram,
        "state_exceeds_ram": state > ram,
        "peak_rss_bytes_per_rank": peak, "peak_rss_over_ram": sum(peak) / ram,
    }


def run_peer(args) -> dict:
    """DeepSpeed on the same model, in its interpreter, through bench_step's worker."""
    ds = types.SimpleNamespace(world=args.world, threads=args.threads, vocab=args.vocab,
                               dim=args.hidden, layers=args.layers, batch=args.batch,
                               seq=args.seq, steps=args.steps, warmup=args.warmup,
                               path=args.path, rule=args.rule, bucket_bytes=args.bucket_bytes,
                               deepspeed_python=args.deepspeed_python, timeout=args.timeout,
                               deepspeed_offload_params=args.deepspeed_offload_params)
    return run_deepspeed(ds, master=True, script=os.path.join(TOOLS, "bench_step.py"), zero_init=True)


# -- the driver ---------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    from offload_engine.units import parse_bytes
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--path", help="directory on the NVMe (a temporary folder is made in it and removed)")
    p.add_argument("--params", type=float, default=3e9,
                   help="about this many parameters; picks --hidden and --layers (default 3e9)")
    p.add_argument("--state-over-ram", type=float, default=None,
                   help="at least this many times this machine's RAM of optimizer state "
                        "under --rule (e.g. 1.1): the model grows past --params where needed")
    p.add_argument("--hidden", type=int, default=None, help="model width (elements)")
    p.add_argument("--layers", type=int, default=None, help="decoder blocks")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rule", choices=("adamw", "muon"), default="adamw",
                   help="adamw: every parameter on AdamW; muon: ZeroMuon's rule")
    p.add_argument("--world", type=int, choices=(1, 2), default=1)
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: cores / W)")
    p.add_argument("--steps", type=int, default=3, help="measured steps (median)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--bucket-bytes", type=parse_bytes, default=parse_bytes("64MiB"))
    p.add_argument("--pool", type=parse_bytes, default=parse_bytes("2GiB"),
                   help="pinned pool per rank in front of the NVMe state (bytes)")
    p.add_argument("--io-threads", type=int, default=8)
    p.add_argument("--queue-depth", type=int, default=8)
    p.add_argument("--block-size", type=parse_bytes, default=parse_bytes("4MiB"))
    p.add_argument("--probe-layers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2],
                   help="layer counts of the in-memory probes (comma separated, two)")
    p.add_argument("--no-probe", action="store_true", help="skip the compute-only probes")
    p.add_argument("--fio-size", type=parse_bytes, default=parse_bytes("1GiB"))
    p.add_argument("--fio-runs", type=int, default=3)
    p.add_argument("--peer", choices=("none", "deepspeed"), default="none")
    p.add_argument("--deepspeed-python", default=os.environ.get(DEEPSPEED_PYTHON_ENV),
                   help=f"interpreter with deepspeed 0.19.8 (default ${DEEPSPEED_PYTHON_ENV})")
    p.add_argument("--deepspeed-offload-params", choices=("nvme", "none"), default="none",
                   help="--rule adamw: DeepSpeed's parameters in host memory as ZeroMuon's "
                        "(default: optimizer state on NVMe only) or on NVMe too (ZeRO-Infinity)")
    p.add_argument("--timeout", type=int, default=4 * 3600, help="seconds per run")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes, seconds, the same code and JSON (figures mean nothing)")
    args = p.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        ranks = _spawn(json.loads(args.worker), _rank_main)
        print("BENCH_RESULT " + json.dumps({"ranks": ranks}))
        return 0
    if not args.path or not os.path.isdir(args.path):
        print("bench_train_large: --path must be an existing directory", file=sys.stderr)
        return 2
    import psutil
    ram = psutil.virtual_memory().total
    if args.state_over_ram:
        args.params = max(args.params, params_for_state(args.state_over_ram * ram, args.vocab,
                                                        args.rule))
    if args.hidden is None or args.layers is None:
        hidden, layers = shape_for(args.params, args.vocab)
        args.hidden, args.layers = args.hidden or hidden, args.layers or layers
    cores = os.cpu_count() or 1
    args.threads = args.threads or max(1, cores // args.world)
    load0 = os.getloadavg()
    args.path = tempfile.mkdtemp(prefix="bench_train_large_", dir=args.path)
    report = {"settings": {k: getattr(args, k) for k in (
        "rule", "world", "vocab", "hidden", "layers", "steps", "warmup", "batch", "seq", "threads",
        "bucket_bytes", "pool", "io_threads", "queue_depth", "block_size", "probe_layers")},
        "params": decoder_params(args.vocab, args.hidden, args.layers)}
    failed = False
    try:
        if shutil.which("fio"):
            from bench_store import fio_mixed_gbps
            report["fio"] = fio_mixed_gbps(args.path, args.fio_size, args.block_size,
                                           args.queue_depth, args.fio_runs)
        else:
            report["fio"] = {"skipped": "fio is not installed (apt-get install fio): no I/O bound"}
        fio_gbps = report["fio"].get("mixed", {}).get("gbps")
        compute = {"skipped": "--no-probe"} if args.no_probe else compute_only(args)
        report["compute_only"] = compute
        raw = run_ranks(args, "nvme", args.layers)
        if "error" in raw:
            report["zeromuon"], failed = raw, True
        else:
            report["zeromuon"] = {**summarize(raw["ranks"], compute, fio_gbps, ram),
                                  "wall_s": raw["wall_s"]}
        failed = failed or "error" in compute
        if args.peer == "deepspeed":
            if not args.deepspeed_python:
                report["deepspeed"] = {"skipped": f"no interpreter with deepspeed: pass "
                                                  f"--deepspeed-python or set {DEEPSPEED_PYTHON_ENV}"}
            else:
                # the disk need hold one side's state at a time (36 GB each at 3 B)
                shutil.rmtree(os.path.join(args.path, "state"), ignore_errors=True)
                report["deepspeed"] = run_peer(args)
                ours = report["zeromuon"]
                if "error" not in report["deepspeed"] and "error" not in ours:
                    report["deepspeed"]["ours_over_deepspeed"] = {
                        "step": ours["step_s"] / report["deepspeed"]["step_s"],
                        "iteration": ours["iteration_s"] / report["deepspeed"]["iteration_s"]}
    finally:
        shutil.rmtree(args.path, ignore_errors=True)
    import torch
    report["environment"] = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpus": cores,
                             "ram_bytes": ram, "torch": torch.__version__,
                             "platform": platform.platform(), "loadavg_before": load0,
                             "loadavg_after": os.getloadavg()}
    print(json.dumps(report, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
