"""`offload-engine demo`: the whole product on one machine, end to end.

W processes train a small decoder-only transformer with FSDP2 + ZeroMuon, optimizer state
on NVMe under --store; the run saves a checkpoint mid-way and is then killed (SIGKILL); a
new run resumes from the checkpoint; an uninterrupted reference run shows the resumed loss
curve is bit for bit the same; the checkpoint is consolidated to safetensors, inspected,
and planned; a report says where every byte went.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

from ..units import format_bytes
from ..errors import InputError

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as cli.main returns for Ctrl-C

PRESET_NAMES = ("medium", "moe", "small", "tiny")  # offload_engine.demo.model.PRESETS


def add_parser(subparsers):
    p = subparsers.add_parser(
        "demo", help="train a small transformer with FSDP2 + ZeroMuon (state on NVMe), crash, "
                     "resume, consolidate, inspect and plan",
        description=__doc__.splitlines()[0] + " Runs on CPU (gloo) or CUDA (nccl).")
    p.add_argument("--world-size", type=int, default=2, help="processes (default 2)")
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    p.add_argument("--model", choices=PRESET_NAMES, default="small",
                   help="model size (default small: about 11 M parameters); moe: a tiny "
                        "mixture of experts (4 experts per layer, top-2 router, grouped expert "
                        "stacks on Muon, one matrix per expert)")
    p.add_argument("--store", default=None, metavar="DIR",
                   help="directory for optimizer state and checkpoints (default: a temporary "
                        "folder under the current directory, removed at the end)")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the uninterrupted reference run (faster; no bitwise comparison)")
    p.add_argument("--keep", action="store_true", help="keep the store directory")
    p.set_defaults(run=run)
    return p


def _split(model) -> tuple[int, int, int, int, int]:
    """(Muon elements, Muon matrices, AdamW elements, AdamW tensors, expert matrices): a
    stack of expert matrices counts one matrix per expert."""
    from ..optim.param_rules import default_use_muon, is_expert_stack
    muon = adamw = n_muon = n_adamw = n_experts = 0
    for name, p in model.named_parameters():
        if default_use_muon(name, p):
            stack = is_expert_stack(name, p.ndim)
            mats = p.shape[0] if stack else 1
            muon, n_muon = muon + p.numel(), n_muon + mats
            n_experts += mats if stack else 0
        else:
            adamw, n_adamw = adamw + p.numel(), n_adamw + 1
    return muon, n_muon, adamw, n_adamw, n_experts


def _row(rec: dict) -> str:
    moved = rec["read"] + rec["written"]
    gbps = moved / rec["opt_s"] / 1e9 if rec["opt_s"] > 0 else 0.0
    hits = rec["hits"] + rec["misses"]
    rate = 100.0 * rec["hits"] / hits if hits else 100.0
    mark = ("  checkpoint committed" if rec.get("checkpoint") else
            "  checkpoint started (written while training goes on)" if rec.get("checkpoint_started")
            else "")
    return (f"  {rec['step']:4d}  {rec['loss']:7.4f}  {rec['step_s']:6.2f}  {rec['opt_s']:6.2f}  "
            f"{format_bytes(rec['read']):>10}  {format_bytes(rec['written']):>10}  {gbps:6.2f}  "
            f"{rate:5.1f}%{mark}")


HEADER = ("  step     loss  step s   opt s   NVMe read  NVMe write   GB/s   hits")


def _du(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            fp = os.path.join(root, f)
            if not os.path.islink(fp):
                total += os.stat(fp).st_blocks * 512
    return total


def run(args) -> int:
    if args.world_size < 1 or args.steps < 4:
        raise InputError("--world-size must be >= 1 and --steps >= 4")
    base = args.store or tempfile.mkdtemp(prefix="offload-engine-demo-", dir=os.getcwd())
    try:
        return _run(args, base)
    except KeyboardInterrupt:  # the training processes are stopped and the folder cleaned
        print("offload-engine demo: interrupted (Ctrl-C)"
              + (f"; kept {base}" if args.keep or args.store else ""), file=sys.stderr)
        return EXIT_INTERRUPTED


def _run(args, base: str) -> int:
    from ..demo.model import build_model, count_parameters
    from ..demo.pool import demo_pool
    from ..demo.train import TrainConfig, launch
    from .main import main as cli_main

    os.makedirs(base, exist_ok=True)
    t_start = time.perf_counter()
    ckpt = os.path.join(base, "checkpoints")
    save_at = args.steps // 2
    crash_at = min(args.steps - 1, save_at + max(1, args.steps // 6))
    model = build_model(args.model)
    muon, n_muon, adamw, n_adamw, n_experts = _split(model)
    state_bytes = 4 * muon + 8 * adamw
    pool = demo_pool(args.model, args.world_size)
    per_rank = state_bytes // args.world_size
    experts = f", {n_experts} of them experts" if n_experts else ""
    print(f"offload-engine demo: FSDP2 + ZeroMuon, {args.world_size} processes "
          f"({'nccl' if _cuda() else 'gloo, CPU'}), model {args.model!r}: "
          f"{count_parameters(model) / 1e6:.1f} M parameters ({muon / 1e6:.1f} M in {n_muon} "
          f"matrices on Muon{experts}, {adamw / 1e6:.2f} M in {n_adamw} tensors on AdamW).")
    moves = (f"streamed through a {format_bytes(pool.cpu_budget)} pinned pool per rank "
             f"(buckets of {format_bytes(pool.bucket_bytes)})" if pool.cpu_budget < per_rank else
             f"held whole in a {format_bytes(pool.cpu_budget)} pinned pool per rank (the "
             f"{format_bytes(per_rank)} of a rank fit: NVMe is only written at the end)")
    print(f"Optimizer state: {format_bytes(state_bytes)} (momentum + Adam moments), home tier "
          f"NVMe under {base}, {moves}.\n")
    common = dict(model=args.model, world_size=args.world_size, steps=args.steps,
                  checkpoint_dir=ckpt)
    try:
        print(f"[1/6] training: checkpoint after step {save_at}, then the run is killed "
              f"(SIGKILL) after step {crash_at}")
        print(HEADER)
        first = launch(TrainConfig(store_dir=os.path.join(base, "run1"), checkpoint_steps=[save_at],
                                   kill_after=crash_at, **common),
                       on_step=lambda r: print(_row(r), flush=True))
        print(f"  -> killed: {first['killed']}; checkpoint: {os.path.join(ckpt, 'latest')}\n")

        print(f"[2/6] resuming from the checkpoint of step {save_at} in new processes: model, "
              "optimizer, LR schedule, data sampler and RNG states (dropout) restored")
        print(HEADER)
        second = launch(TrainConfig(store_dir=os.path.join(base, "run2"), resume=True, **common),
                        on_step=lambda r: print(_row(r), flush=True))
        resumed = {r["step"]: r["loss_bits"] for r in second["records"]}
        before_crash = {r["step"]: r["loss_bits"] for r in first["records"]}
        overlap = [s for s in resumed if s in before_crash]
        same_overlap = all(resumed[s] == before_crash[s] for s in overlap)
        print(f"  -> steps {overlap[0]}-{overlap[-1]} replayed after the crash: losses "
              f"{'bitwise equal' if same_overlap else 'DIFFERENT'} to the killed run's\n")

        same_ref = None
        if not args.no_reference:
            print(f"[3/6] uninterrupted reference run, {args.steps} steps (no checkpoint, no crash)")
            ref = launch(TrainConfig(store_dir=os.path.join(base, "run3"), model=args.model,
                                     world_size=args.world_size, steps=args.steps))
            ref_bits = {r["step"]: r["loss_bits"] for r in ref["records"]}
            same_ref = all(ref_bits[s] == b for s, b in resumed.items())
            print(f"  -> resumed curve (steps {min(resumed)}-{max(resumed)}) "
                  f"{'equals the uninterrupted run bit for bit' if same_ref else 'DIFFERS from the uninterrupted run'}"
                  f"; final loss {ref['records'][-1]['loss']:.4f} "
                  f"(first {ref['records'][0]['loss']:.4f})\n")
        else:
            print("[3/6] reference run skipped (--no-reference)\n")

        out = os.path.join(base, "consolidated")
        print(f"[4/6] consolidate the checkpoint to Hugging Face safetensors: {out}")
        rc = _interruptible(cli_main(["consolidate", ckpt, out, "--verify"]))
        print()
        print("[5/6] inspect the checkpoint")
        rc_inspect = _optional(cli_main, ["inspect", ckpt])
        print()
        print("[6/6] plan the run just made: the same model, world size, dtype, store and disk")
        rc_plan = _optional(cli_main, ["plan", "--model", _shapes_file(base, model),
                                       *_plan_of_the_run(args, base)])
        print()

        recs = first["records"] + second["records"]
        read = sum(r["read"] for r in recs)
        written = sum(r["written"] for r in recs)
        a2a = sum(r["a2a_sent"] for r in recs)
        print("Where the bytes went (rank 0, training runs 1 and 2):")
        print(f"  optimizer state on NVMe: read {format_bytes(read)}, written {format_bytes(written)} "
              f"over {len(recs)} steps ({format_bytes(read / len(recs))} read per step)")
        print(f"  all_to_all (bf16 Muon inputs and outputs) sent: {format_bytes(a2a)}")
        print(f"  state files on disk (run 2): {format_bytes(_du(os.path.join(base, 'run2')))}; "
              f"checkpoints: {format_bytes(_du(ckpt))}; safetensors: {format_bytes(_du(out))}")
        ok = rc == 0 and same_overlap and same_ref is not False
        print(f"\ndemo {'finished' if ok else 'FAILED'} in {time.perf_counter() - t_start:.0f} s"
              + ("" if rc_inspect is None and rc_plan is None else ""))
        return 0 if ok else 1
    finally:
        if not args.keep and args.store is None:
            shutil.rmtree(base, ignore_errors=True)
        elif args.keep or args.store:
            print(f"(kept {base})")


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _optional(cli_main, argv):
    """Run a subcommand if this build has it."""
    from .main import COMMANDS
    if argv[0] not in COMMANDS:
        print(f"  (`offload-engine {argv[0]}` is not built yet)")
        return None
    try:
        return _interruptible(cli_main(argv))
    except SystemExit as e:  # argparse
        return int(e.code or 0)


def _interruptible(rc: int) -> int:
    """A subcommand's exit code; Ctrl-C during it (which it reports as 130) stops the demo."""
    if rc == EXIT_INTERRUPTED:
        raise KeyboardInterrupt
    return rc


def _plan_of_the_run(args, base: str) -> list[str]:
    """plan's options for what the demo ran (demo/train.py): fp32 parameters on this
    machine's CPU or GPUs, state homed on NVMe under ``base`` through the run's pool."""
    from ..demo.pool import demo_pool
    pool = demo_pool(args.model, args.world_size)
    return ["--world-size", str(args.world_size), "--gpus-per-node", str(args.world_size),
            "--param-dtype", "fp32", "--device", "cuda" if _cuda() else "cpu",
            "--home", "nvme", "--cpu-budget", str(pool.cpu_budget),
            "--bucket-bytes", str(pool.bucket_bytes),
            "--prefetch-depth", "2", "--nvme", base]


def _shapes_file(base: str, model) -> str:
    """The model's named shapes as JSON, the plan's model input."""
    import json
    path = os.path.join(base, "model_shapes.json")
    with open(path, "w") as f:
        json.dump({n: list(p.shape) for n, p in model.named_parameters()}, f)
    return path
