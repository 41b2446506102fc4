"""``offload-engine consolidate SRC OUT``: a DeepSpeed ZeRO checkpoint to Hugging Face safetensors.

Exit codes: 0 written (and verified with --verify), 1 --verify found a difference, 2 bad
input (missing/corrupt/unsafe files, wrong rank count, bad option), printed as one line.
"""

from __future__ import annotations

import argparse
import sys
import time

from offload_engine.checkpoint.consolidate import DTYPES, consolidate, verify_output
from offload_engine.checkpoint.deepspeed import DeepSpeedSource
from offload_engine.checkpoint.our_source import CheckpointSource, is_our_checkpoint
from offload_engine.checkpoint.safetensors_writer import parse_size


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
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                   help="dtype of every float tensor (default fp32, as zero_to_fp32); "
                        "integer and bool tensors are copied bit for bit")
    p.add_argument("--exclude-frozen", action="store_true",
                   help="leave out parameters that had requires_grad=False")
    p.add_argument("--tag", help="tag folder to read (default: the content of SRC/latest)")
    p.add_argument("--verify", action="store_true",
                   help="re-read the output with the safetensors library and compare it with "
                        "the checkpoint; exit 1 on any difference")
    p.add_argument("--window-size", default="64MiB",
                   help="bytes per reusable I/O buffer; at most 6 are in use at once "
                        "(default: 64MiB)")
    p.set_defaults(run=run)
    return p


class ProgressLine:
    """A one-line progress display on a terminal, redrawn at most 5 times a second."""

    def __init__(self, stream=sys.stderr, label: str = "consolidate"):
        self.stream = stream
        self.label = label
        self.t0 = time.monotonic()
        self.last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self.last < 0.2:
            return
        self.last = now
        pct = 100.0 * done / total if total else 100.0
        rate = done / max(now - self.t0, 1e-9) / 1e6
        self.stream.write(f"\r{self.label}: {done / 1e9:.2f}/{total / 1e9:.2f} GB "
                          f"{pct:5.1f}% {rate:8.1f} MB/s")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()


def run(args: argparse.Namespace) -> int:
    max_shard = parse_size(args.max_shard_size)
    window = parse_size(args.window_size)
    dtype = DTYPES[args.dtype]
    kind = CheckpointSource if is_our_checkpoint(args.src) else DeepSpeedSource
    with kind(args.src, tag=args.tag, exclude_frozen=args.exclude_frozen) as source:
        progress = ProgressLine() if sys.stderr.isatty() else None
        result = consolidate(source, args.out, max_shard_bytes=max_shard, dtype=dtype,
                             window_bytes=window, progress=progress)
        shards = sum(f.endswith(".safetensors") for f in result.files)
        print(f"{source.describe()}: wrote {result.tensors} tensors, {result.total_bytes} bytes, "
              f"{shards} shard(s){' + index' if result.index else ''} to {args.out}"
              + (f"; tied: {', '.join(f'{a} -> {o}' for a, o in sorted(result.aliases.items()))}"
                 if result.aliases else ""))
        if args.verify:
            problems = verify_output(source, args.out, dtype=dtype, chunk_bytes=window)
            if problems:
                for line in problems:
                    print(f"offload-engine consolidate: verify: {line}", file=sys.stderr)
                return 1
            print(f"verified: every tensor in {args.out} matches the checkpoint")
    return 0
