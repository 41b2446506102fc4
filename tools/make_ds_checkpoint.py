#!/usr/bin/env python3
"""Make a real DeepSpeed ZeRO-3 checkpoint of a ~270M-parameter model, on CPU.

The model is bench_step's transformer-shaped stack (``build_model``: embedding, N blocks of
q/k/v/o and MLP matrices with LayerNorms, final norm, untied output head); the defaults
(vocab 32000, dim 1024, 16 layers) give 266.9M fp32 parameters. DeepSpeed (CPU accelerator,
gloo) trains it for ``--steps`` steps with ``torch.optim.AdamW`` as a client optimizer at
ZeRO stage 3 and world size ``--world``, then calls ``save_checkpoint``. The result holds
the fp32 master partitions and both Adam moments: about 12 bytes per parameter (3.2 GB).

Run it with an interpreter that has deepspeed (0.19.8) installed; it starts its own ranks
with ``torch.distributed.run``:

    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python tools/make_ds_checkpoint.py --out /work/bench/ds270m

``tools/bench_consolidate.py --make`` calls it the same way.

``--smoke`` makes the same kind of checkpoint of a tiny model (vocab 256, width 64, 2
blocks: 0.2M parameters) on a free port, in seconds once DeepSpeed's CPU ops are built: the
test suite runs it (where deepspeed is installed) so the tool cannot rot.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="checkpoint folder to write (created)")
    p.add_argument("--world", type=int, default=2, help="data-parallel ranks (default 2)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--steps", type=int, default=1, help="training steps before saving")
    p.add_argument("--tag", default=None, help="checkpoint tag (default global_step<steps>)")
    p.add_argument("--port", type=int, default=None, help="rendezvous port (default 29533; "
                                                          "with --smoke, a free one)")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny model (vocab 256, width 64, 2 blocks), for the test suite")
    args = p.parse_args(argv)
    if args.smoke:
        args.vocab, args.dim, args.layers = SMOKE_MODEL
    if args.port is None:
        args.port = free_port() if args.smoke else 29533
    return args


# --smoke: vocab, width, blocks
SMOKE_MODEL = (256, 64, 2)


def free_port() -> int:
    """A TCP port nobody listens on now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(args: argparse.Namespace) -> None:
    """One rank, started by torch.distributed.run."""
    import torch
    import deepspeed
    from bench_step import build_model, loss_of

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    model = build_model(args.vocab, args.dim, args.layers, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": 3},
           "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    gen = torch.Generator().manual_seed(1234)
    for _ in range(args.steps):
        tokens = torch.randint(0, args.vocab, (1, 17), generator=gen)
        loss = loss_of(engine, tokens)
        engine.backward(loss)
        engine.step()
    tag = args.tag or f"global_step{args.steps}"
    engine.save_checkpoint(args.out, tag=tag)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(args.out, "model_info.json"), "w") as f:
            json.dump({"params": n_params, "vocab": args.vocab, "dim": args.dim, "layers": args.layers,
                       "world": args.world, "zero_stage": 3, "dtype": "fp32", "steps": args.steps,
                       "tag": tag, "deepspeed": deepspeed.__version__, "torch": torch.__version__}, f)
            f.write("\n")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Start ``--world`` ranks of this script with torch.distributed.run."""
    os.makedirs(args.out, exist_ok=True)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OE_MAKE_DS_RANK": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.world}",
           "--master_addr=127.0.0.1", f"--master_port={args.port}", os.path.abspath(__file__), *argv]
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, env=env).returncode
    print(f"make_ds_checkpoint: exit {rc} after {time.perf_counter() - t0:.1f} s, {args.out}", file=sys.stderr)
    return rc


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if os.environ.get("OE_MAKE_DS_RANK"):
        rank_main(args)
        # The checkpoint is complete and the process group is gone, but a DeepSpeed CPU rank
        # aborts at interpreter exit ("terminate called without an active exception": a
        # joinable C++ thread destroyed during teardown), which would fail the launch.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
