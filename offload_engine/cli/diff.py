"""``offload-engine diff A B``: names, shapes and dtypes added, removed or changed, then the
values of every tensor both hold, within tolerance. A and B may be of different kinds
(a checkpoint against its consolidated safetensors, a DeepSpeed checkpoint against ours, a
live store against a checkpoint of its run: the optimizer states both hold). The root of a
store of several ranks (a folder per rank) is read as one store, whole tensors put together
from the ranks' rows; ranks missing or from different steps or runs are bad input.

Exit codes: 0 equal within tolerance; 1 different; 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys

from ..formats import KIND_LABELS
from ..formats.detect import store_root_ranks
from ..offline.diff import diff_sources
from ..offline.rank_stores import open_store_root
from .inspect import _num, _table, add_expert_argument, expert_view, open_input
from .printable import printable
from .progress import ProgressLine, wanted
from ..errors import InputError

EXIT_DIFFERENT = 1


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "diff", help="compare two stores, checkpoints, DeepSpeed checkpoints or safetensors",
        description="Compare A with B (the reference): tensors added, removed, or changed in "
                    "shape or dtype, then per tensor the largest absolute difference and the "
                    "relative L2 difference ||A-B||/||B||. Equal means |A-B| <= atol + rtol*|B| "
                    "everywhere (NaN equals NaN). By default each tensor's value is compared: "
                    "its master weights where it has them, else the parameter. Exit codes: 0 "
                    "equal within tolerance, 1 different, 2 bad input.")
    p.add_argument("a", metavar="A", help="first input: any kind inspect reads; a store's root "
                                           "(the nvme_paths directory) reads every rank's "
                                           "folder as one store")
    p.add_argument("b", metavar="B", help="second input, the reference (the same kinds)")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0)")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0)")
    p.add_argument("--state", action="append", metavar="S",
                   help="'weights' (default: master, else param), 'all' (every state both "
                        "hold; states held by one side only are differences), or state names "
                        "(repeatable)")
    p.add_argument("--name", action="append", metavar="GLOB",
                   help="only tensors whose name matches (repeatable)")
    add_expert_argument(p)
    p.add_argument("--metadata-only", action="store_true",
                   help="compare names, shapes, dtypes and states only; read no values")
    p.add_argument("--ignore-dtype", action="store_true",
                   help="a dtype change alone is not a difference (values are still compared)")
    p.add_argument("--generation-a", "--tag-a", dest="generation_a", metavar="G",
                   help="checkpoint generation or DeepSpeed tag of A")
    p.add_argument("--generation-b", "--tag-b", dest="generation_b", metavar="G",
                   help="checkpoint generation or DeepSpeed tag of B")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="list every compared tensor, not only those that differ")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)
    return p


def _mode(states):
    if not states or states == ["weights"]:
        return "weights"
    if states == ["all"]:
        return "all"
    if "weights" in states or "all" in states:
        raise InputError("--state weights and --state all cannot be combined with other states")
    return states


def open_side(path: str, generation: str | None, expert: int | None):
    """Input ``path`` as ``inspect`` opens it, except the root of a store (the directory
    given as ``nvme_paths``): every rank's store folder read as one store
    (``offline.rank_stores``), so whole tensors compare as they do in a one-rank store."""
    ranks = store_root_ranks(path) if generation is None else []
    if not ranks:
        return open_input(path, generation, expert)
    return expert_view(open_store_root(path, ranks), expert)


def run(args: argparse.Namespace) -> int:
    if args.rtol < 0 or args.atol < 0:
        raise InputError("--rtol and --atol must be >= 0")
    mode = _mode(args.state)
    with open_side(args.a, args.generation_a, args.expert) as a, \
            open_side(args.b, args.generation_b, args.expert) as b:
        progress = ProgressLine(label="diff") if wanted(args) else None
        report = diff_sources(a, b, rtol=args.rtol, atol=args.atol, mode=mode, names=args.name,
                              ignore_dtype=args.ignore_dtype, progress=progress,
                              values=not args.metadata_only)
        label_a = f"{KIND_LABELS[a.info.kind]} {a.info.path}"
        label_b = f"{KIND_LABELS[b.info.kind]} {b.info.path}"
    if args.json:
        json.dump({"a": label_a, "b": label_b, "rtol": args.rtol, "atol": args.atol,
                   "mode": mode, **report.as_dict()}, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        _print(report, label_a, label_b, args)
    return 0 if report.equal else EXIT_DIFFERENT


def _print(report, label_a: str, label_b: str, args) -> None:
    out = sys.stdout
    print(f"A  {printable(label_a)}", file=out)
    print(f"B  {printable(label_b)}", file=out)
    mode = _mode(args.state)
    print(f"compared {len(report.values)} tensor states ("
          f"{mode if isinstance(mode, str) else ', '.join(mode)}), rtol {args.rtol:g}, "
          f"atol {args.atol:g}", file=out)
    if report.removed:
        print(f"only in A ({len(report.removed)}): {', '.join(map(printable, report.removed))}", file=out)
    if report.added:
        print(f"only in B ({len(report.added)}): {', '.join(map(printable, report.added))}", file=out)
    for c in report.changed:
        state = f"/{c['state']}" if "state" in c else ""
        print(f"changed {c['what']}: {printable(c['name'])}{printable(state)}: "
              f"{printable(c['a'])} -> {printable(c['b'])}", file=out)
    rows = [v for v in report.values if args.verbose or not v["equal"]]
    if rows:
        _table(["NAME", "STATE", "MAX_ABS", "REL_L2", "MISMATCHES", "COUNT"],
               [[v["name"], v["state"], _num(v["max_abs"]), _num(v["rel_l2"]),
                 str(v["mismatches"]), str(v["count"])] for v in rows], out)
    differing = sum(not v["equal"] for v in report.values)
    if report.equal:
        print("equal within tolerance", file=out)
    else:
        print(f"different: {differing} tensor state(s) outside tolerance, "
              f"{len(report.removed)} only in A, {len(report.added)} only in B, "
              f"{len(report.changed)} changed", file=out)
