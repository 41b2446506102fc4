"""``offload-engine consolidate SRC OUT``: one of our checkpoints or a DeepSpeed ZeRO
checkpoint (or safetensors) to Hugging Face (sharded) safetensors.

Exit codes: 0 written (and verified with --verify), 1 --verify found a difference, 2 bad
input (missing/corrupt/unsafe files, wrong rank count, bad option, another run writing into
OUT), printed as one line; 130 Ctrl-C, 143 SIGTERM (the staging folder removed, OUT holding
one whole export).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ..offline.consolidate import OUTPUT_DTYPES, consolidate, verify_output
from ..offline.hf_experts import EXPERT_MODES, expert_naming, find_config
from ..offline.hf_extras import copy_extras, find_extras
from ..offline.hf_shards import parse_size
from ..offline.state_dict import open_weights
from .printable import printable
from .progress import ProgressLine, wanted
from .terminate import until_sigterm

# DeepSpeed's zero_to_fp32.py spellings, accepted so its command lines work unchanged;
# hidden from --help (listed in the description) so each option shows once.
DEEPSPEED_SPELLINGS = (("--max_shard_size", "max_shard_size", {}),
                       ("--exclude_frozen_parameters", "exclude_frozen", {"action": "store_true"}),
                       ("-t", "tag", {}))


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "consolidate",
        help="merge an offload-engine or DeepSpeed ZeRO-1/2/3 checkpoint into Hugging Face "
             "(sharded) safetensors",
        description="Merge the weights of an offload-engine checkpoint (any world size; its fp32 "
                    "masters where the run kept them), or "
                    "the fp32 master weights of a DeepSpeed ZeRO-1/2/3 checkpoint (plus "
                    "frozen parameters and buffers), into model.safetensors, or "
                    "model-0000i-of-0000N.safetensors + model.safetensors.index.json, streaming "
                    "with bounded memory. deepspeed is not needed. DeepSpeed's zero_to_fp32.py "
                    "spellings are accepted too: -t, --max_shard_size, "
                    "--exclude_frozen_parameters, --safe_serialization (the output is always "
                    "safetensors) and -d (--debug).")
    p.add_argument("src", metavar="SRC", help="checkpoint folder (ours or DeepSpeed's: the one "
                                              "holding 'latest', or a generation or tag "
                                              "folder in it)")
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
                   help="bytes per reusable I/O buffer; 4 are held, 5 when casting (to bf16, say) "
                        "(default: 64MiB)")
    p.add_argument("--no-copy-config", dest="copy_config", action="store_false",
                   help="do not copy config.json, generation_config.json and tokenizer files "
                        "found beside the checkpoint into OUT (copied by default, so "
                        "from_pretrained(OUT) works)")
    p.add_argument("--experts", choices=EXPERT_MODES, default="auto",
                   help="grouped expert stacks ([E, ...] under an 'experts' module): "
                        "'per-expert' writes one tensor per expert under the names Hugging "
                        "Face checkpoints use (docs/consolidate.md), 'grouped' as stored; "
                        "'auto' (default) is per-expert when config.json beside the "
                        "checkpoint names a known MoE model_type, else grouped")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: what was written, bytes, seconds")
    for flag, dest, extra in DEEPSPEED_SPELLINGS:
        p.add_argument(flag, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **extra)
    p.add_argument("--safe_serialization", action="store_true", default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)
    p.add_argument("-d", dest="debug", action="store_true", default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    return until_sigterm(lambda: _run(args),
                         f"offload-engine consolidate: terminated (SIGTERM); {args.out} holds "
                         f"one whole export, the earlier one or this run's")


def _run(args: argparse.Namespace) -> int:
    max_shard = parse_size(args.max_shard_size)
    window = parse_size(args.window_size)
    dtype = args.dtype
    started = time.perf_counter()
    extras = find_extras(args.src)
    with open_weights(args.src, args.tag) as source:
        # metadata only: bad expert stacks are refused before anything is written
        source, experts_note = expert_naming(source, args.experts, find_config(extras))
        progress = ProgressLine() if wanted(args) else None
        result = consolidate(source, args.out, max_shard_bytes=max_shard, dtype=dtype,
                             window_bytes=window, exclude_frozen=args.exclude_frozen,
                             progress=progress)
        copied = copy_extras(extras, args.out) if args.copy_config else []
        written_s = time.perf_counter() - started
        shards = sum(f.endswith(".safetensors") for f in result.files)
        if not args.json:
            print(printable(  # names and paths come from the input
                f"{source.describe()}: wrote {result.tensors} tensors, {result.total_bytes} "
                f"bytes, {shards} shard(s){' + index' if result.index else ''} to {args.out}"
                + (f"; tied: {', '.join(f'{a} -> {o}' for a, o in sorted(result.aliases.items()))}"
                   if result.aliases else "")
                + (f"; copied {', '.join(copied)}" if copied else "")
                + (f"; {experts_note}" if experts_note else "")))
        problems = None
        if args.verify:
            problems = verify_output(source, args.out, dtype=dtype, chunk_bytes=window,
                                     exclude_frozen=args.exclude_frozen)
            for line in problems:
                print(f"offload-engine consolidate: verify: {printable(line)}", file=sys.stderr)
            if not problems and not args.json:
                print(f"verified: every tensor in {printable(args.out)} matches the checkpoint")
        if args.json:
            summary = _summary(source, result, args, written_s, problems,
                               time.perf_counter() - started, copied)
            print(json.dumps({**summary, "experts": experts_note or None}, indent=2))
    return 1 if problems else 0


def _summary(source, result, args, written_s: float, problems, total_s: float,
             copied: list[str]) -> dict:
    """The --json object: input, output files (name, bytes), counts, seconds."""
    info = source.info
    return {
        "source": {"kind": info.kind, "path": info.path, "format": info.format,
                   "generation": info.generation, "world_size": info.world_size},
        "out": os.path.abspath(args.out),
        "files": [{"name": f, "bytes": os.path.getsize(os.path.join(args.out, f))}
                  for f in result.files],
        "tensors": result.tensors,
        "tensor_bytes": result.total_bytes,
        "dtype": args.dtype,
        "aliases": result.aliases,
        "copied": copied,
        "excluded_frozen": bool(args.exclude_frozen),
        "peak_buffer_bytes": result.peak_buffer_bytes,
        "write_seconds": round(written_s, 3),
        "verified": None if problems is None else not problems,
        "verify_problems": problems or [],
        "seconds": round(total_s, 3),
    }
