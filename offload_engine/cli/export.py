"""``offload-engine export PATH NAME --out FILE``: one logical tensor, reassembled from its
shards, as .npy, .safetensors or .pt.

Exit codes: 0 written; 2 bad input (unknown tensor or state, corrupt data, bad checksum).
"""

from __future__ import annotations

import argparse
import json
import time

from ..offline.export import export_tensor
from ..units import format_bytes
from .inspect import add_expert_argument, open_input
from .printable import printable
from .progress import ProgressLine, wanted

# the spellings --dtype takes (offload_engine.dtypes knows them all)
DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "float64")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "export", help="write one tensor (any state), reassembled from its shards, to "
                       ".npy / .safetensors / .pt",
        description="Reassemble tensor NAME of PATH (any kind inspect reads) from its shards "
                    "and write it to FILE; the format follows the extension (.npy, "
                    ".safetensors, .pt). Without --state the tensor's value is written: its "
                    "master weights where it has them, else the parameter. Checkpoint chunks "
                    "are checked against their recorded checksums.")
    p.add_argument("path", metavar="PATH", help="input (store, checkpoint, DeepSpeed, safetensors)")
    p.add_argument("name", metavar="NAME", help="tensor name (as inspect lists it; with "
                                                "--expert, a stack's name or NAME[E])")
    add_expert_argument(p)
    p.add_argument("--state", metavar="S", help="state to write (param, master, "
                                                "momentum_buffer, exp_avg, exp_avg_sq, ...)")
    p.add_argument("--out", required=True, metavar="FILE",
                   help="output file: .npy, .safetensors or .pt")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="cast before writing (numpy has no "
                                                            "bfloat16: use float32 for .npy)")
    p.add_argument("--generation", "--tag", dest="generation", metavar="G",
                   help="checkpoint generation or DeepSpeed tag (default: 'latest')")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: what was written, bytes, seconds")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    with open_input(args.path, args.generation, args.expert) as source:
        name = source.resolve(args.name) if args.expert is not None else args.name
        progress = ProgressLine(label="export") if wanted(args) else None
        try:
            r = export_tensor(source, name, args.out, state=args.state, dtype=args.dtype,
                              progress=progress)
        finally:
            if progress is not None:
                progress.close()
    if args.json:
        print(json.dumps({**r, "source": source.info.path,
                          "seconds": round(time.perf_counter() - started, 3)}, indent=2))
        return 0
    print(f"wrote {printable(r['name'])} ({printable(r['state'])}, shape {r['shape']}, "
          f"{r['dtype']}) to {printable(r['path'])} "
          f"({format_bytes(r['bytes'])})")
    return 0
