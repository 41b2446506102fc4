"""``offload-engine import deepspeed CKPT OUT --world-size N``: a DeepSpeed ZeRO-1/2/3 run
as one of our checkpoints, to resume with ZeroMuon (``offline/ds_import.py``).

Exit codes: 0 written and committed, 2 bad input (a missing, corrupt or unsupported
checkpoint, a bad option), printed as one line.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..offline.hf_shards import parse_size
from ..errors import InputError
from .progress import RankProgress, wanted


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "import", help="bring another framework's checkpoint over (import deepspeed)",
        description="Write another framework's training checkpoint as an offload-engine "
                    "checkpoint that load_checkpoint resumes, one subcommand per framework.")
    sub = p.add_subparsers(dest="import_command", required=True, metavar="FORMAT")
    d = sub.add_parser(
        "deepspeed", help="a DeepSpeed ZeRO-1/2/3 checkpoint (AdamW or Muon runs)",
        description="Write a DeepSpeed ZeRO-1/2/3 checkpoint (fp32 or bf16; AdamW, or "
                    "MuonWithAuxAdam) as an offload-engine checkpoint for ZeroMuon "
                    "at --world-size ranks: fp32 masters, Adam moments and steps, Muon "
                    "momentum, buffers, tied names, and the global step and LR scheduler state. "
                    "Which parameters use Muon comes from the checkpoint where it records "
                    "it, else from ZeroMuon's default rule; where the two differ, a count "
                    "per kind with a few names (--verbose: a line per parameter). Streams with bounded memory; deepspeed is not needed and no "
                    "code from the pickles runs.")
    d.add_argument("ckpt", metavar="CKPT", help="DeepSpeed checkpoint folder (the one holding "
                                                "'latest' and the tag folders)")
    d.add_argument("out", metavar="OUT", help="checkpoint folder to write the generation into "
                                              "(created; a committed generation of the same "
                                              "step is never replaced)")
    d.add_argument("--world-size", type=int, required=True, metavar="N",
                   help="ranks of the ZeroMuon run that resumes it")
    d.add_argument("--tag", help="tag folder to read (default: the content of CKPT/latest)")
    d.add_argument("--model-config", metavar="CONFIG_JSON",
                   help="the model's Hugging Face config.json: its torch_dtype is the "
                        "parameters' dtype (default: bf16 for a bf16 run, else fp32)")
    d.add_argument("--window-size", default="32MiB",
                   help="bytes read from the DeepSpeed files at a time (default: 32MiB)")
    d.add_argument("--json", action="store_true",
                   help="print one JSON object: the summary, disagreements included")
    d.add_argument("-v", "--verbose", action="store_true",
                   help="list every parameter whose optimizer differs from ZeroMuon's default "
                        "rule (default: a count per kind and a few names)")
    d.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ..offline.ds_import import disagreement_summary, from_deepspeed

    if args.world_size < 1:
        raise InputError(f"--world-size must be at least 1, not {args.world_size}")
    progress = RankProgress(args.world_size) if wanted(args) else None
    try:
        summary = from_deepspeed(args.ckpt, args.out, args.world_size, tag=args.tag,
                                 model_config=args.model_config,
                                 window_bytes=parse_size(args.window_size), progress=progress)
    finally:
        if progress is not None:
            progress.close()
    if args.json:
        print(json.dumps(summary.to_dict(), indent=2))
        return 0
    if args.verbose:
        lines = [d.line() for d in summary.disagreements]
    else:
        lines = disagreement_summary(summary.disagreements)
        if lines:
            lines[-1] += " (--verbose lists each, --json has them all)"
    for line in lines:
        print(f"disagreement: {line}", file=sys.stderr)
    for alias, owner in summary.tied.items():
        print(f"note: {alias} is tied to {owner}: recorded as tied, as DeepSpeed saved it",
              file=sys.stderr)
    for note in summary.notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"{summary.source}: wrote {summary.generation} for {summary.world_size} ranks "
          f"(step {summary.step}; {len(summary.muon)} Muon, {len(summary.adamw)} AdamW, "
          f"{len(summary.other)} other tensors; {summary.bytes_written} bytes)")
    return 0
