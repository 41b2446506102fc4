"""``offload-engine config from-deepspeed DS_CONFIG``: a DeepSpeed JSON config as a store
config and ZeroMuon's arguments, with every key reported as mapped (and how) or ignored
(and why). The rules: ``plan/deepspeed_config.py`` and docs/migrate.md.

Exit codes: 0 translated; 2 bad input (not strict JSON, over the size or nesting limits, not
a regular file, a key of the wrong type or range, a translation that is not a valid store
config, e.g. NVMe offload without nvme_path), printed as one line. Everything written is
strict JSON (no NaN); keys are printed with control characters escaped.
"""

from __future__ import annotations

import argparse
import json
import os
import textwrap

from ..layout.metadata import replacing
from ..plan.deepspeed_config import load
from ..errors import InputError


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "config", help="translate configs from other tools (config from-deepspeed)",
        description="Translate another tool's configuration into offload-engine's.")
    sub = p.add_subparsers(dest="config_command", required=True, metavar="SOURCE")
    ds = sub.add_parser(
        "from-deepspeed", help="a DeepSpeed JSON config as a store config and ZeroMuon "
                               "arguments",
        description="Translate a DeepSpeed JSON config (zero_optimization.offload_optimizer, "
                    "aio, sub_group_size, save_muon_momentum_buffer_in_memory, the optimizer "
                    "block, bf16/fp16) into a validated store config and ZeroMuon's keyword "
                    "arguments. Every key of the input is listed as mapped (with the rule) or "
                    "ignored (with the reason); the rules are in docs/migrate.md.")
    ds.add_argument("ds_config", metavar="DS_CONFIG", help="DeepSpeed JSON config file")
    ds.add_argument("--out", metavar="STORE_JSON",
                    help="write the store config here (load it with StoreConfig.from_file)")
    ds.add_argument("--optimizer-out", metavar="OPTIM_JSON",
                    help="write ZeroMuon's keyword arguments here (see docs/migrate.md)")
    ds.add_argument("--json", action="store_true",
                    help="print one JSON object: store, optimizer, report, warnings")
    ds.set_defaults(run=run)
    return p


def _json(data) -> str:
    """Strict JSON (a non-finite number raises rather than being written as NaN)."""
    return json.dumps(data, indent=2, allow_nan=False)


def _printable(key: str) -> str:
    """``key`` as it is when printable, else JSON-escaped: a key's bytes never reach the
    terminal as control sequences."""
    return key if key.isprintable() else json.dumps(key)[1:-1]


def _write_json(path: str, data: dict) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise InputError(f"{path}: the folder {directory} does not exist")
    with replacing(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(_json(data) + "\n")
            f.flush()
            os.fsync(f.fileno())


def run(args: argparse.Namespace) -> int:
    result = load(args.ds_config)
    if args.out:
        _write_json(args.out, result.store)
    if args.optimizer_out:
        _write_json(args.optimizer_out, result.optimizer)
    if args.json:
        print(_json(result.as_json()))
        return 0
    width = max((len(_printable(r.key)) for r in result.report), default=0)
    for r in result.report:
        what = (f"mapped -> {r.target}: " if r.status == "mapped" else "ignored: ") + r.rule
        head = f"{_printable(r.key):<{width}}  {json.dumps(r.value, allow_nan=False)}"
        print(head)
        print(textwrap.fill(what, 88, initial_indent="    ", subsequent_indent="    "))
    mapped = sum(r.status == "mapped" for r in result.report)
    print(f"\n{len(result.report)} keys: {mapped} mapped, {len(result.report) - mapped} ignored")
    for w in result.warnings:
        print(f"warning: {w}")
    if result.loop_code:
        print("\ntraining loop (what DeepSpeed's engine did in engine.step(); paste where it "
              "belongs):")
        for key, lines in result.loop_code.items():
            print(f"    # {key}")
            for line in lines:
                print(f"    {line}")
    print("\nstore config" + (f" (written to {args.out})" if args.out else "") + ":")
    print(_json(result.store))
    print("\nZeroMuon arguments" + (f" (written to {args.optimizer_out})"
                                     if args.optimizer_out else "") + ":")
    print(_json(result.optimizer))
    return 0
