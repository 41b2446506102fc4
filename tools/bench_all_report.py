#!/usr/bin/env python3
"""bench_all's report: each benchmark's headline, the markdown table, and the report's files.

``tools/bench_all.py`` writes ``bench_all.json`` and ``bench_all.md`` after every benchmark;
this renders the table again from a JSON (after a run on another machine, or to paste into
the README):

    python tools/bench_all_report.py results/full/bench_all.json   # prints the markdown
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# -- the headline -------------------------------------------------------------------------------
def dig(obj, *keys):
    """``obj[k1][k2]...``, or None where a key is missing."""
    for k in keys:
        if not isinstance(obj, (dict, list)):
            return None
        try:
            obj = obj[k]
        except (KeyError, IndexError, TypeError):
            return None
    return obj


def fmt(x, spec=".3g", suffix="") -> str:
    return "?" if x is None else f"{x:{spec}}{suffix}"


def count(n) -> str:
    """Parameters as people write them: 181 k, 20.3 M, 2.70 B."""
    if n is None:
        return "?"
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g} {unit}"
    return str(n)


def last_error_line(tail: list[str] | None) -> str:
    """The line of a failed run's output that says how it ended: the last one that is not a
    warning (Python prints leaked-semaphore warnings at exit, after the traceback)."""
    for line in reversed(tail or []):
        line = line.strip()
        if line and "Warning:" not in line and not line.startswith("warnings.warn("):
            return line[-120:]
    return ""


def _step_line(r: dict) -> str:
    parts = []
    for name, run in (r.get("results") or {}).items():
        if "error" in run:   # with the line that says how it ended (a SIGKILL is the OOM killer's)
            last = last_error_line(run.get("stderr_tail"))
            parts.append(f"{name}: failed ({run['error']}{': ' + last if last else ''})")
        elif name.startswith("deepspeed"):
            parts.append(f"ours / {name} iteration {fmt(dig(run, 'ours_over_deepspeed', 'iteration'))}x, "
                         f"step {fmt(dig(run, 'ours_over_deepspeed', 'step'))}x")
        else:
            parts.append(f"{name}: NVMe / max(I/O, compute) {fmt(run.get('ratio_nvme_over_bound'), '.3f')}, "
                         f"NVMe / in-memory {fmt(run.get('ratio_nvme_over_cpu'), '.3f')}")
    return "; ".join(parts)


def _train_line(r: dict) -> str:
    z = r.get("zeromuon") or {}
    if "error" in z:
        return f"ZeroMuon failed ({z['error']})"
    line = (f"{count(r.get('params'))} parameters, state {fmt(z.get('state_over_ram'))}x RAM: "
            f"step / bound {fmt(z.get('step_over_bound'), '.3f')} (bound: {z.get('bound_is')}), "
            f"bytes / formula {fmt(dig(z, 'moved_over_formula', 0), '.3f')}, "
            f"peak RSS {fmt(z.get('peak_rss_over_ram'), '.3f')} of RAM")
    ds = r.get("deepspeed")
    if ds:
        line += ("; DeepSpeed: " + (ds.get("skipped") or (f"failed ({ds['error']})" if "error" in ds else
                 f"ours / DeepSpeed iteration {fmt(dig(ds, 'ours_over_deepspeed', 'iteration'))}x")))
    return line


def _bound_and_rss(wall_over_bound, peak_rss_bytes) -> str:
    """Consolidate's and import's own figures: wall time over the fio bound, peak RSS."""
    return f"wall / fio bound {fmt(wall_over_bound)}, peak RSS {fmt((peak_rss_bytes or 0) / 2**20, '.0f')} MiB"


def headline(name: str, r: dict) -> str:
    """The one line of the headline table for a tool's JSON (``?`` where a figure is absent)."""
    kind = name.split("_")[0]
    if kind == "io":
        w, rd = dig(r, "best_peer", "write"), dig(r, "best_peer", "read")
        return (f"engine / best peer: write {fmt(dig(w, 'engine_vs_best'))}x ({dig(w, 'method')}), "
                f"read {fmt(dig(rd, 'engine_vs_best'))}x ({dig(rd, 'method')})")
    if kind == "store":
        return (f"wall / bound {fmt(dig(r, 'compute_bound', 'median_wall_over_bound'))} compute-bound, "
                f"{fmt(dig(r, 'io_bound', 'median_wall_over_bound'))} I/O-bound")
    if kind == "step":
        return _step_line(r)
    if kind == "checkpoint":
        return (f"blocking save at {fmt(dig(r, 'blocking', 'gbps_vs_fio_write'))} of fio's write; "
                f"asynchronous: {fmt(dig(r, 'async', 'exposed'))} of it exposed")
    if kind == "consolidate":
        ours = _bound_and_rss(dig(r, "throughput", "ours_wall_over_disk_bound"),
                              dig(r, "methods", "ours", "peak_rss_bytes_median"))
        failed = [run for run in dig(r, "methods", "deepspeed", "runs") or [] if run.get("returncode")]
        if failed:   # the tool still measured ours: say why the comparison is missing
            return f"zero_to_fp32 failed ({last_error_line(failed[-1].get('stderr_tail')) or '?'}); {ours}"
        return (f"{fmt(r.get('speedup'))}x faster than zero_to_fp32, {fmt(r.get('rss_ratio'), '.3f')} "
                f"of its peak RSS, equal: {dig(r, 'outputs_equal', 'equal')}; {ours}")
    if kind == "import":
        return _bound_and_rss(dig(r, "throughput", "wall_over_disk_bound"),
                              dig(r, "import", "peak_rss_bytes_median"))
    if kind == "inspect":
        read_mb = (dig(r, "list", "read_bytes") or 0) / 1e6
        return (f"listing {fmt(dig(r, 'list', 'seconds'))} s, {fmt(read_mb)} MB read; "
                f"--stats at {fmt(dig(r, 'stats', 'ratio_vs_fio'))}x fio")
    if kind == "startup":
        return f"plan in {fmt(dig(r, 'over_import_torch', 'plan_llama70b_w64'))}x the time of import torch"
    if kind == "train":
        return _train_line(r)
    return "see the JSON"


def table(report: dict) -> str:
    """The headline table (docs/benchmarks.md's: benchmark, latest result, date), then the
    commands and where the figures come from."""
    m, date = report["machine"], report["date"][:10]
    lines = [f"# bench_all --{report['mode']}", "",
             "| benchmark | latest result | date |", "| --- | --- | --- |"]
    for name, e in report["benchmarks"].items():
        status = e.get("status")
        result = (e.get("headline") if status == "ok" else
                  f"{status}: {e.get('why', '')}".rstrip(": "))
        if e.get("peers_skipped"):
            result += " (without " + ", ".join(sorted(e["peers_skipped"])) + ")"
        when = "-" if status == "pending" else e.get("date", date)[:10]
        lines.append(f"| `{name}`: {e['title']} | {result.replace('|', '/')} | {when} |")
    lines += ["", "Commands:", ""]
    lines += [f"- `{name}`: `{e['command']}`" for name, e in report["benchmarks"].items()]
    disk = m["disk"]
    lines += ["", f"Measured: {m['cpu_model']}, {m['cores']} cores, {m['ram_bytes'] / 2**30:.1f} GiB RAM, "
              f"{disk['fstype']} on {disk['device']} ({disk.get('model') or 'model unknown'}), "
              f"{report['date']}, commit {report['git']['commit']}"
              f"{' (uncommitted changes)' if report['git']['dirty'] else ''}, load average "
              f"{report['loadavg_before'][0]:.2f} before and {report['loadavg_after'][0]:.2f} after, "
              f"`python tools/bench_all.py --{report['mode']}`"
              + (f", in {len(report['sessions'])} sessions (`--resume`; each benchmark's date "
                 f"and commit are in the JSON)" if len(report.get("sessions", [])) > 1 else "")
              + ".", ""]
    return "\n".join(lines)


# -- the files ----------------------------------------------------------------------------------
def load_previous(out: str, mode: str, machine: dict) -> dict:
    """The report a run left in ``out`` (for --resume), checked to be of ``mode`` and of
    this machine: figures of another machine or mode cannot share one table."""
    path = os.path.join(out, "bench_all.json")
    try:
        with open(path) as f:
            report = json.load(f)
    except FileNotFoundError:
        return {}
    except ValueError as e:
        raise SystemExit(f"bench_all: --resume: {path} is not JSON ({e})")
    if not isinstance(report, dict):
        raise SystemExit(f"bench_all: --resume: {path} is not a bench_all report")
    if report.get("mode") != mode:
        raise SystemExit(f"bench_all: --resume: {path} is a --{report.get('mode')} run, not --{mode}")
    same = ("cpu_model", "cores", "ram_bytes")
    theirs, ours = report.get("machine", {}), machine
    if any(theirs.get(k) != ours[k] for k in same) or \
            dig(theirs, "disk", "device") != ours["disk"]["device"]:
        raise SystemExit(f"bench_all: --resume: {path} was measured on another machine or disk "
                         f"({', '.join(f'{k}={theirs.get(k)}' for k in same)}, disk "
                         f"{dig(theirs, 'disk', 'device')}); start a new --out")
    return report


def write_report(out: str, report: dict) -> str:
    """bench_all.json and bench_all.md in ``out`` (replaced whole, so a reader never sees
    half a file); returns the JSON text."""
    os.makedirs(out, exist_ok=True)
    text = json.dumps(report, indent=2)
    for name, body in (("bench_all.json", text + "\n"), ("bench_all.md", table(report))):
        tmp = os.path.join(out, f".{name}.tmp")
        with open(tmp, "w") as f:
            f.write(body)
        os.replace(tmp, os.path.join(out, name))
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("report", help="a bench_all.json")
    args = p.parse_args(argv)
    try:
        with open(args.report) as f:
            report = json.load(f)
        if not isinstance(report, dict) or not {"mode", "machine", "benchmarks"} <= set(report):
            raise ValueError("no mode, machine and benchmarks at its top")
        print(table(report), end="")
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"bench_all_report: {args.report}: not a bench_all report ({e!r})", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
