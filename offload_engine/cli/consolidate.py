"""``offload-engine consolidate SRC OUT``: one of our checkpoints or a DeepSpeed ZeRO
checkpoint (or safetensors) to Hugging Face (sharded) safetensors.

Exit codes: 0 written (and verified with --verify), 1 --verify found a difference, 2 bad
input (missing/corrupt/unsafe files, wrong rank count, bad option), printed as one line.
"""

from __future__ import annotations

import argparse
import sys

from ..formats import open_source
from ..offline.consolidate import OUTPUT_DTYPES, consolidate, verify_output
from ..offline.hf_shards import parse_size
from .progress import ProgressLine


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "consolidate",
        help="merge an offload-engine or DeepSpeed ZeRO-1/2/3 checkpoint into Hugging Face "
             "(sharded) safetensors",
        description="Merge the parameters of an offload-engine checkpoint (any world size), or "
                    "the fp32 master weights of a DeepSpeed ZeRO-1/2/3 checkpoint (plus "
                    "frozen parameters and buffers), into model.safetensors, or "
                    "model-0000i-of-0000N.safetensors + model.safetensors.index.json, streaming "
                    "with bounded memory. deepspeed is not needed.")
    p.add_argument("src", metavar="SRC", help="checkpoint folder (ours or DeepSpeed's, holding "
                                              "'latest' or the tag folder named by --tag)")
    p.add_argument("out", metavar="OUT", help="output folder (created; earlier model*.safetensors "
                                              "files in it are replaced)")
    p.add_argument("--max-shard-size", default="5GB",
                   help="largest shard, decimal units as Hugging Face: 5GB = 5*10**9 bytes; "
                        "also 500MB, 1GiB, 4096 (default: 5GB)")
    p.add_argument("--dtype", choices=sorted(OUTPUT_DTYPES), default="fp32",
                   help="dtype of every float tensor (default fp32, as zero_to_fp32); "
                        "integer and bool tensors are copied bit for bit")
    p.add_argument("--exclude-frozen", action="store_true",
                   help="leave out parameters that had requires_grad=False")
    p.add_argument("--tag", help="tag folder to read (default: the content of SRC/latest)")
    p.add_argument("--verify", action="store_true",
                   help="re-read the output with the safetensors library and compare it with "
                        "the checkpoint; exit 1 on any difference")
    p.add_argument("--window-size", default="64MiB",
                   help="bytes per reusable I/O buffer; at most 5 are in use at once "
                        "(default: 64MiB)")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    max_shard = parse_size(args.max_shard_size)
    window = parse_size(args.window_size)
    dtype = args.dtype
    with open_source(args.src, args.tag) as source:
        if source.info.kind == "store":
            raise ValueError(f"{args.src}: a live store directory holds optimizer state, not "
                             f"the model's weights; consolidate a checkpoint (save_checkpoint)")
        progress = ProgressLine() if sys.stderr.isatty() else None
        result = consolidate(source, args.out, max_shard_bytes=max_shard, dtype=dtype,
                             window_bytes=window, exclude_frozen=args.exclude_frozen,
                             progress=progress)
        shards = sum(f.endswith(".safetensors") for f in result.files)
        print(f"{source.describe()}: wrote {result.tensors} tensors, {result.total_bytes} bytes, "
              f"{shards} shard(s){' + index' if result.index else ''} to {args.out}"
              + (f"; tied: {', '.join(f'{a} -> {o}' for a, o in sorted(result.aliases.items()))}"
                 if result.aliases else ""))
        if args.verify:
            problems = verify_output(source, args.out, dtype=dtype, chunk_bytes=window,
                                     exclude_frozen=args.exclude_frozen)
            if problems:
                for line in problems:
                    print(f"offload-engine consolidate: verify: {line}", file=sys.stderr)
                return 1
            print(f"verified: every tensor in {args.out} matches the checkpoint")
    return 0
