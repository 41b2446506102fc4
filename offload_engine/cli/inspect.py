"""``offload-engine inspect PATH``: what a store, checkpoint, DeepSpeed checkpoint or
safetensors file holds, from metadata; with ``--stats``, streamed statistics per tensor
and state and an optimizer-health summary.

Exit codes: 0 ok; 3 ``--stats`` (or ``--plot``) found NaN or Inf; 2 bad input (one line).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys

from ..formats import KIND_LABELS, open_source
from ..formats.detect import store_root_ranks
from ..offline.experts import ExpertView, expert_count
from ..offline.health import health_summary
from ..offline.select import name_matches, select
from ..units import format_bytes, parse_bytes
from .printable import printable
from .progress import ProgressLine, wanted
from ..errors import InputError

EXIT_NONFINITE = 3
MAX_FILES_SHOWN = 12


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "inspect", help="list (and with --stats, summarise) a store, checkpoint, DeepSpeed "
                        "checkpoint or safetensors file",
        description="List what PATH holds: a live store directory, an offload-engine "
                    "checkpoint, a DeepSpeed ZeRO-1/2/3 checkpoint, a .safetensors file or a "
                    "sharded index. Listing reads metadata only. --stats streams every "
                    "selected tensor state once, in bounded memory. Exit codes: 0 ok, 3 "
                    "--stats found NaN or Inf, 2 bad input.")
    p.add_argument("path", metavar="PATH", help="store directory (or the store root holding "
                                                "rank0/, rank1/, ...: every rank is listed), "
                                                "checkpoint folder or generation, DeepSpeed "
                                                "folder, .safetensors file, index .json, or a "
                                                "folder of them")
    p.add_argument("--generation", "--tag", dest="generation", metavar="G",
                   help="checkpoint generation or DeepSpeed tag (default: the one 'latest' names)")
    p.add_argument("--name", action="append", metavar="GLOB",
                   help="only tensors whose name matches (fnmatch glob; repeatable)")
    p.add_argument("--state", action="append", metavar="S",
                   help="only these states: param, master, momentum_buffer, exp_avg, "
                        "exp_avg_sq, ... (repeatable)")
    add_expert_argument(p)
    p.add_argument("--stats", action="store_true",
                   help="read the data: count, min, max, mean, rms, L2, NaN, Inf, zero "
                        "fraction per tensor and state, and an optimizer-health summary")
    p.add_argument("--plot", metavar="OUT.png",
                   help="also draw per-layer L2 norms of every state into OUT.png (needs "
                        "matplotlib; implies --stats)")
    p.add_argument("--top", type=int, default=5, metavar="N",
                   help="largest values listed in the health summary (default 5)")
    p.add_argument("--window-size", default="16MiB",
                   help="bytes per read window of stores and checkpoints (default 16MiB)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)
    return p


def add_expert_argument(p: argparse.ArgumentParser) -> None:
    """``--expert E``, the same in inspect, diff and export."""
    p.add_argument("--expert", type=int, metavar="E",
                   help="only expert E: each grouped expert stack ([E, ...] under an "
                        "'experts' module) as its slice NAME[E], and the tensors of expert E "
                        "kept one per expert (names holding 'experts.E.')")


def _dtype(d) -> str:
    return d.name


def _num(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return str(x)
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return f"{x:.4g}"


def summarise(source, selected) -> dict:
    info = source.info
    by_state: dict[str, int] = {}
    by_rank: dict = {}
    dtypes: dict[str, int] = {}
    for t, states in selected:
        dtypes[_dtype(t.dtype)] = dtypes.get(_dtype(t.dtype), 0) + 1
        for s in states:
            sm = t.states[s]
            by_state[s] = by_state.get(s, 0) + sm.nbytes
            for r, n in sm.bytes_by_rank.items():
                by_rank[r] = by_rank.get(r, 0) + n
    kinds: dict[str, int] = {}
    for t, _ in selected:
        kinds[t.kind] = kinds.get(t.kind, 0) + 1
    return {
        "kind": info.kind, "kind_label": KIND_LABELS[info.kind], "path": info.path,
        "format": info.format, "format_version": info.format_version,
        "generation": info.generation, "step": info.step, "world_size": info.world_size,
        "tensors": len(selected), "tensor_kinds": kinds,
        "bytes_by_state": by_state,
        "bytes_by_rank": {("unsharded" if r is None else str(r)): n
                          for r, n in sorted(by_rank.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))},
        "dtypes": dtypes,
        "files": [{"path": p, "bytes": n} for p, n in info.files],
        "file_count": info.file_count if info.file_count is not None else len(info.files),
        "notes": list(info.notes),
    }


def tied_aliases(source, names) -> dict[str, str]:
    """``{alias: owner}`` of the tied names that match ``names`` (``--name`` globs)."""
    return {a: o for a, o in source.aliases().items() if name_matches(a, names)}


def _tied_row(alias: str, owner) -> dict:
    return {"name": alias, "shape": list(owner.shape), "dtype": _dtype(owner.dtype),
            "optimizer": None, "kind": "tied", "tied_to": owner.name, "states": [], "bytes": 0}


def _tensor_rows(source, selected, aliases: dict[str, str]) -> list[dict]:
    """One row per selected tensor; a tied name follows its owner as a row of its own
    (``tied_to`` the owner; no states or bytes: it stores nothing), or comes last when
    its owner is not selected."""
    tied_to: dict[str, list[str]] = {}
    for alias, owner in aliases.items():
        tied_to.setdefault(owner, []).append(alias)
    rows = []
    for t, states in selected:
        row = {"name": t.name, "shape": list(t.shape), "dtype": _dtype(t.dtype),
               "optimizer": t.optimizer, "kind": t.kind, "states": states,
               "bytes": sum(t.states[s].nbytes for s in states)}
        if t.kind == "array":
            row.update(numel=t.numel, home=t.home)
        experts = expert_count(t.name, t.shape)
        if experts is not None:
            row["experts"] = experts
        rows.append(row)
        rows.extend(_tied_row(alias, t) for alias in tied_to.pop(t.name, ()))
    for owner, names in tied_to.items():
        rows.extend(_tied_row(alias, source.tensor(owner)) for alias in names)
    return rows


def _table(header: list[str], rows: list[list[str]], out) -> None:
    """Columns padded to their widest cell; every cell through ``printable`` (names come
    from the input)."""
    rows = [[printable(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(), file=out)
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip(), file=out)


def print_summary(s: dict, out) -> None:
    label = s["kind_label"]
    print(f"kind        {label} ({s['format']}"
          + (f", version {s['format_version']}" if s["format_version"] is not None else "") + ")",
          file=out)
    print(f"path        {printable(s['path'])}", file=out)
    if s["generation"] is not None:
        print(f"generation  {s['generation']}", file=out)
    if s["step"] is not None:
        print(f"step        {s['step']}", file=out)
    if s["world_size"] is not None:
        print(f"world size  {s['world_size']}", file=out)
    kinds = ", ".join(f"{n} {k}" for k, n in s["tensor_kinds"].items())
    print(f"tensors     {s['tensors']}" + (f" ({kinds})" if kinds else ""), file=out)
    stacks = s.get("expert_stacks")
    if stacks:
        print(f"experts     {stacks['count']} grouped stack(s) of "
              f"{', '.join(map(str, stacks['experts']))} experts (dim 0; --expert E lists one)",
              file=out)
    if s.get("expert") is not None:
        print(f"expert      {s['expert']} (a stack's slice is listed as NAME[{s['expert']}])",
              file=out)
    if s.get("aliases"):
        print("tied        " + ", ".join(f"{printable(a)} = {printable(o)}"
                                          for a, o in s["aliases"].items()), file=out)
    print("dtypes      " + ", ".join(f"{d} {n}" for d, n in s["dtypes"].items()), file=out)
    print("bytes       " + ", ".join(f"{k} {format_bytes(v)}" for k, v in s["bytes_by_state"].items()),
          file=out)
    if set(s["bytes_by_rank"]) - {"unsharded"}:
        print("by rank     " + ", ".join(f"{k}: {format_bytes(v)}" for k, v in s["bytes_by_rank"].items()),
              file=out)
    files = s["files"]
    total = sum(f["bytes"] or 0 for f in files)
    print(f"files       {s['file_count']}" + (f" ({format_bytes(total)})" if s["file_count"] == len(files) else
                                               f" (manifest {format_bytes(total)}; arrays and chunk files not listed)"),
          file=out)
    base = s["path"] if os.path.isdir(s["path"]) else os.path.dirname(s["path"])
    shown = [(printable(os.path.relpath(f["path"], base)), f["bytes"])
             for f in files[:MAX_FILES_SHOWN]]
    width = max((len(p) for p, _ in shown), default=0)
    for p, n in shown:
        print(f"  {p:<{width}}  {format_bytes(n)}", file=out)
    if len(files) > MAX_FILES_SHOWN:
        print(f"  ... {len(files) - MAX_FILES_SHOWN} more", file=out)
    for note in s["notes"]:
        print(f"note        {printable(note)}", file=out)


def print_tensors(rows: list[dict], out) -> None:
    if rows and all(r["kind"] == "array" for r in rows):
        _table(["NAME", "DTYPE", "NUMEL", "HOME"],
               [[r["name"], r["dtype"], str(r["numel"]), str(r["home"])] for r in rows], out)
        return
    _table(["NAME", "SHAPE", "DTYPE", "OPTIMIZER", "STATES"],
           [[r["name"], "[" + ", ".join(map(str, r["shape"])) + "]", r["dtype"],
             r["optimizer"] or ("-" if r["kind"] == "param" else r["kind"]),
             f"= {r['tied_to']}" if r["kind"] == "tied" else ", ".join(r["states"])]
            for r in rows], out)


def print_stats(stats: list[dict], out) -> None:
    _table(["NAME", "STATE", "COUNT", "MIN", "MAX", "MEAN", "RMS", "L2", "NAN", "INF", "ZEROS"],
           [[s["name"], s["state"], str(s["count"]), _num(s["min"]), _num(s["max"]),
             _num(s["mean"]), _num(s["rms"]), _num(s["l2"]), str(s["nan"]), str(s["inf"]),
             "-" if s["zero_fraction"] is None else f"{100 * s['zero_fraction']:.1f}%"]
            for s in stats], out)


def print_health(h: dict, out) -> None:
    print("optimizer health", file=out)
    if h["momentum_rms_per_layer"]:
        print("  momentum RMS per layer:", file=out)
        for e in h["momentum_rms_per_layer"]:
            print(f"    {printable(e['layer']):<40} {printable(e['state']):<16} {_num(e['rms'])}",
                  file=out)
    else:
        print("  momentum RMS per layer: no momentum_buffer or exp_avg state selected", file=out)
    v = h["adam_exp_avg_sq"]
    if v:
        low, high = v["min"], v["max"]
        print(f"  Adam exp_avg_sq: min {_num(low['value'])} ({printable(low['tensor'])}), "
              f"max {_num(high['value'])} ({printable(high['tensor'])})", file=out)
    if h["largest_values"]:
        print("  largest |values|: " + ", ".join(
            f"{_num(e['abs_max'])} {printable(e['tensor'])}/{printable(e['state'])}"
            for e in h["largest_values"]),
            file=out)
    if h["nonfinite"]:
        print(f"  NaN/Inf in {len(h['nonfinite_layers'])} layer(s): "
              + ", ".join(map(printable, h["nonfinite_layers"])), file=out)
        for e in h["nonfinite"]:
            print(f"    {printable(e['tensor'])}/{printable(e['state'])}: {e['nan']} NaN, "
                  f"{e['inf']} Inf", file=out)
    else:
        print("  NaN/Inf: none", file=out)


def listing(source, names=None, states=None) -> tuple[list, dict, list[dict]]:
    """What plain ``inspect`` lists, from metadata: the selected ``(tensor, states)``, the
    summary (tied names under ``aliases``) and one row per tensor and tied name."""
    selected = select(source.tensors(), names, states)
    summary = summarise(source, selected)
    aliases = tied_aliases(source, names)
    summary["aliases"] = aliases
    stacks = [t.shape[0] for t, _ in selected if expert_count(t.name, t.shape) is not None]
    if stacks:
        summary["expert_stacks"] = {"count": len(stacks), "experts": sorted(set(stacks))}
    summary["expert"] = getattr(source, "expert", None)
    return selected, summary, _tensor_rows(source, selected, aliases)


def open_input(path: str, generation: str | None = None, expert: int | None = None,
               **options):
    """``open_source``, then ``gc.freeze()``: this process is short-lived, and a large
    manifest's millions of objects would otherwise be walked by every later full garbage
    collection (0.8 s each for 50,000 tensors over 8 ranks). With ``expert``, the view of
    that expert alone (``offline.experts.ExpertView``)."""
    source = expert_view(open_source(path, generation, **options), expert)
    gc.freeze()
    return source


def expert_view(source, expert: int | None):
    """``source``, or with ``expert`` its view of that expert alone (closed on an error)."""
    if expert is None:
        return source
    try:
        return ExpertView(source, expert)
    except BaseException:
        source.close()
        raise


def run(args: argparse.Namespace) -> int:
    window = parse_bytes(args.window_size)
    out = sys.stdout
    ranks = store_root_ranks(args.path) if args.generation is None else []
    if ranks and args.plot:
        raise InputError(f"--plot draws one store: pass one rank's folder (e.g. "
                         f"{ranks[0][1]}), not the store root")
    if ranks:  # a store root: each rank's store, in rank order
        results = [(r, inspect_one(d, None, args, window)) for r, d in ranks]
        if args.json:
            json.dump({"store_root": os.path.abspath(args.path),
                       "ranks": [{"rank": r, **res} for r, res in results]},
                      out, indent=2, default=str)
            out.write("\n")
        else:
            for i, (r, res) in enumerate(results):
                print(("\n" if i else "") + f"== rank {r} ==", file=out)
                print_result(res, args, out)
        return max(_exit_code(res) for _, res in results)
    result = inspect_one(args.path, args.generation, args, window)
    if args.json:
        json.dump(result, out, indent=2, default=str)
        out.write("\n")
    else:
        print_result(result, args, out)
    return _exit_code(result)


def _exit_code(result: dict) -> int:
    return EXIT_NONFINITE if "health" in result and result["health"]["nonfinite"] else 0


def inspect_one(path: str, generation: str | None, args: argparse.Namespace,
                window: int) -> dict:
    """What ``inspect`` reports of one input: summary and tensors, with ``--stats`` the
    statistics and health summary (and the plot drawn)."""
    with open_input(path, generation, args.expert, window_bytes=window) as source:
        selected, summary, rows = listing(source, args.name, args.state)
        want_stats = args.stats or args.plot
        result = {"summary": summary, "tensors": rows}
        if want_stats:
            keys = [(t.name, s) for t, states in selected for s in states]
            from ..offline.inspect_stats import collect_stats  # reduces in torch

            progress = ProgressLine(label="inspect") if wanted(args) else None
            stats, nbytes = collect_stats(source, keys, progress)
            result["stats"] = [{"name": n, "state": s, **{k: v for k, v in st.items() if k != "sumsq"}}
                               for (n, s), st in stats.items()]
            floating = {(t.name, s) for t, states in selected for s in states
                        if t.states[s].dtype.is_float}
            result["health"] = health_summary(stats, top=args.top, floating=floating)
            result["bytes_read"] = nbytes
            # how the bytes were read, and where that choice came from (device profile)
            result["io"] = getattr(source, "io_settings", None)
            if args.plot:
                from ..offline.plot import plot_layer_norms
                plot_layer_norms(stats, [t.name for t, _ in selected], args.plot,
                                 f"{KIND_LABELS[source.info.kind]}: {source.info.path}",
                                 floating=floating)
                result["plot"] = args.plot
    return result


def print_result(result: dict, args: argparse.Namespace, out) -> None:
    print_summary(result["summary"], out)
    print(file=out)
    print_tensors(result["tensors"], out)
    if "stats" in result:
        print(file=out)
        print_stats(result["stats"], out)
        print(file=out)
        print_health(result["health"], out)
        if args.plot:
            print(f"\nplot written to {args.plot}", file=out)
