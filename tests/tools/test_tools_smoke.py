"""Every tool in tools/ runs in its smoke mode (tiny sizes, seconds), so none can rot unseen.

Each case starts the tool as a user does (a fresh process of this interpreter, or of one
that has deepspeed for the DeepSpeed paths), parses the JSON it prints and checks what a
user reads in it: the keys docs/benchmarks.md shows, figures and ratios present and
positive. The figures of a smoke run mean nothing and are not judged.

A test lists tools/ and fails when a tool has no case here. The DeepSpeed paths run where
deepspeed is importable: in this interpreter, or in the one ``OFFLOAD_ENGINE_DEEPSPEED_PYTHON``
names (a venv with deepspeed 0.19.8 that sees this repo's packages, docs/optimizer.md); the
first run there builds DeepSpeed's CPU ops (minutes). fio-only cases skip without fio.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.paths import ROOT

TOOLS = Path(ROOT) / "tools"
DEEPSPEED_PYTHON_ENV = "OFFLOAD_ENGINE_DEEPSPEED_PYTHON"
SMOKE_TIMEOUT_S = 300
DEEPSPEED_TIMEOUT_S = 900   # the first run builds DeepSpeed's CPU ops


@functools.cache
def deepspeed_python() -> str | None:
    """An interpreter that imports deepspeed: the one the environment variable names, else
    this one when it has deepspeed; None when neither."""
    named = os.environ.get(DEEPSPEED_PYTHON_ENV)
    if named:
        ok = subprocess.run([named, "-c", "import deepspeed"], capture_output=True,
                            env={**os.environ, "DS_ACCELERATOR": "cpu"}, timeout=300)
        return named if ok.returncode == 0 else None
    return sys.executable if importlib.util.find_spec("deepspeed") else None


needs_deepspeed = pytest.mark.skipif(
    "deepspeed_python() is None",
    reason=f"deepspeed is not importable here; set {DEEPSPEED_PYTHON_ENV} to an interpreter "
           "that has it (deepspeed 0.19.8, docs/optimizer.md) to run the DeepSpeed paths")
# DeepSpeed's processes read about 1 GiB (libraries, built ops) and bench_step's writes its
# swap files: over the suite's limit for tests not marked slow (tests/helpers/marker_guard.py)
deepspeed_case = [needs_deepspeed, pytest.mark.slow]
needs_fio = pytest.mark.skipif(shutil.which("fio") is None,
                               reason="fio is not installed (apt-get install fio): the tool "
                                      "measures the disk with it")
needs_time = pytest.mark.skipif(not os.path.exists("/usr/bin/time"),
                                reason="/usr/bin/time is missing (apt-get install time)")


def run(argv: list[str], cwd: Path, *, python: str | None = None,
        timeout: float = SMOKE_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``python tools/<argv[0]> argv[1:]``, which must exit 0."""
    cmd = [python or sys.executable, str(TOOLS / argv[0]), *argv[1:]]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, (f"{' '.join(cmd)}: exit {proc.returncode}\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def run_json(argv: list[str], tmp_path: Path, **kw) -> dict:
    return json.loads(run(argv, tmp_path, **kw).stdout)


def positive(*values) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values)


# -- one function per case: it runs the tool and checks its output ---------------------------

def smoke_bench_checkpoint(tmp_path):
    out = run_json(["bench_checkpoint.py", "--path", str(tmp_path), "--smoke"], tmp_path)
    assert {"model", "store", "baseline", "blocking", "async", "fio", "environment"} <= set(out)
    blocking, asyn = out["blocking"], out["async"]
    assert positive(blocking["save_s"], blocking["checkpoint_bytes"], blocking["gbps"],
                    blocking["gbps_vs_fio_write"], out["fio"]["write_gbps"],
                    out["baseline"]["iteration_s"])
    assert asyn["commit_s"] >= asyn["call_s"] > 0
    assert isinstance(asyn["exposed"], float) and len(asyn["runs"]) == 1
    assert not os.listdir(tmp_path)  # its work folder is removed


def smoke_bench_consolidate(tmp_path):
    """Ours alone on the suite's DeepSpeed fixture: no DeepSpeed needed."""
    out = run_json(["bench_consolidate.py", "--path", str(tmp_path), "--smoke",
                    "--deepspeed-python", ""], tmp_path)
    ours = out["methods"]["ours"]
    assert ours["failed_runs"] == 0 and positive(ours["wall_s_median"], ours["peak_rss_bytes_median"])
    assert positive(out["checkpoint"]["params"], out["checkpoint"]["needed_read_bytes"],
                    out["checkpoint"]["output_bytes"], out["throughput"]["ours_gbps"],
                    out["fio"]["read"]["gbps"], out["fio"]["write"]["gbps"])
    assert "deepspeed" not in out["methods"]
    assert out["speedup"] is None and out["outputs_equal"]["equal"] is None


def smoke_bench_consolidate_deepspeed(tmp_path):
    """The whole comparison: make_ds_checkpoint --smoke, then ours against zero_to_fp32."""
    out = run_json(["bench_consolidate.py", "--path", str(tmp_path), "--smoke", "--make",
                    "--deepspeed-python", deepspeed_python()], tmp_path,
                   timeout=DEEPSPEED_TIMEOUT_S)
    assert out["methods"]["ours"]["failed_runs"] == out["methods"]["deepspeed"]["failed_runs"] == 0
    assert positive(out["speedup"], out["rss_ratio"], out["after_startup"]["work_s"]["deepspeed"],
                    out["throughput"]["deepspeed_gbps"])
    assert set(out["goals_met"]) == {"speedup", "rss_ratio"}
    assert out["outputs_equal"]["equal"] is True, out["outputs_equal"]
    assert out["outputs_equal"]["tensors_compared"] > 0


def smoke_bench_import(tmp_path):
    out = run_json(["bench_import.py", "--path", str(tmp_path), "--smoke"], tmp_path)
    imp, thr = out["import"], out["throughput"]
    assert imp["failed_runs"] == 0 and positive(imp["wall_s_median"], imp["peak_rss_bytes_median"])
    assert positive(out["checkpoint"]["params"], thr["read_bytes"], thr["written_bytes"], thr["gbps"],
                    thr["wall_over_disk_bound"], thr["fio_mixed_gbps"])
    assert out["checkpoint"]["world_size"] == 2


def smoke_bench_inspect(tmp_path):
    out = run_json(["bench_inspect.py", "--path", str(tmp_path), "--smoke"], tmp_path)
    listing, stats = out["list"], out["stats"]
    assert listing["tensors"] == listing["runs"][0]["tensors"] == 200
    assert listing["world_size"] == 2
    assert positive(listing["seconds"], listing["read_bytes"], listing["shard_tables"]["read_bytes"])
    assert isinstance(listing["meets_time_goal"], bool)
    assert positive(stats["stats_gbps"], stats["fio_read_gbps"], stats["ratio_vs_fio"],
                    stats["peak_rss_bytes"])
    assert stats["runs"][0]["bytes_read"] == stats["state_bytes"]   # every byte of state read
    assert stats["runs"][0]["nonfinite"] == 0
    assert not os.listdir(tmp_path)


def smoke_bench_many_tensors(tmp_path):
    out = run_json(["bench_many_tensors.py", "--smoke", "--path", str(tmp_path / "work")],
                   tmp_path)
    table = out["by_dtype"]["fp32"]["summary"]
    assert set(table) == {"consolidate_deepspeed", "import_deepspeed", "inspect_deepspeed",
                          "inspect_ours", "consolidate_ours"}
    for row in table.values():
        assert positive(row["peak_rss_bytes"], row["baseline_peak_rss_bytes"], row["wall_s"])
        assert isinstance(row["goal_met"], bool) and isinstance(row["bytes_per_tensor"], float)
    assert isinstance(out["goal_met"], bool) and "wait4" in out["peak_rss_source"]
    assert sorted(os.listdir(tmp_path / "work")) == []   # checkpoints not kept without --keep


def smoke_bench_io(tmp_path):
    """Runs with or without fio (without: its O_DIRECT loop is the baseline)."""
    out = run_json(["bench_io.py", "--path", str(tmp_path), "--smoke"], tmp_path)
    assert out["size_bytes"] == 16 << 20 and out["runs"] == 1
    engine = out["methods"]["engine"]
    assert positive(engine["read_gbps"], engine["write_gbps"])
    for direction in ("read", "write"):
        assert positive(out["best_peer"][direction]["engine_vs_best"])
    if out["baseline"] == "fio":
        assert positive(out["ratios"]["engine_vs_fio_read"], out["ratios"]["engine_vs_fio_write"])
    assert positive(*out["ratios"].values())


def smoke_bench_startup(tmp_path):
    out = run_json(["bench_startup.py", "--smoke"], tmp_path)
    commands = {"python", "import_torch", "import_ml_dtypes", "plan_llama70b_w64",
                "inspect_deepspeed", "consolidate_help"}
    assert set(out["median_s"]) == set(out["over_import_torch"]) == commands
    assert positive(*out["median_s"].values())
    assert out["over_import_torch"]["import_torch"] == 1.0
    assert isinstance(out["goal_met"], bool)


def _check_bench_step_run(run: dict, masters: bool, rule: str = "muon"):
    assert "error" not in run, run
    assert positive(run["nvme_step_s"], run["cpu_step_s"], run["ratio_nvme_over_bound"],
                    run["ratio_nvme_over_cpu"], run["io_s"], run["io_bytes_per_step_all_ranks"],
                    run["nvme_iteration_s"], run["cpu_iteration_s"],
                    *run["peak_rss_bytes_per_rank"], *run["moved_bytes_per_rank"])
    assert run["world"] == len(run["per_rank"]) == 2
    # peak RSS of training alone (setup excluded), and of a run of the NVMe optimizer without
    # its in-memory twin: the figure held against a peer's
    alone = run["nvme_alone"]
    assert "error" not in alone, alone
    for peaks in (run["training_peak_rss_bytes_per_rank"], alone["training_peak_rss_bytes_per_rank"]):
        assert len(peaks) == 2 and positive(*peaks)
    assert (run["muon_params"] > 0) == (rule == "muon")
    for rank in run["per_rank"]:
        kinds = ({"muon_momentum"} if rule == "muon" else set()) | {"adam_moments"} | (
            {"masters"} if masters else set())
        assert set(rank["bytes_per_param"]) == kinds
        assert positive(rank["moved_bytes"], rank["bundles"], rank["pool_bytes"])
        assert rank["pool_bytes"] < rank["state_bytes"]   # the state streams, as in a real run


def smoke_bench_step(tmp_path):
    out = run_json(["bench_step.py", "--path", str(tmp_path), "--smoke", "--masters", "on"], tmp_path)
    assert set(out["results"]) == {"bf16_params_fp32_masters"}
    _check_bench_step_run(out["results"]["bf16_params_fp32_masters"], masters=True)
    assert positive(out["fio"]["mixed"]["gbps"])
    assert not os.listdir(tmp_path)


def smoke_bench_step_adamw(tmp_path):
    """--rule adamw: every parameter on AdamW (no Muon state, no all_to_all). Beside a
    DeepSpeed that the kernel kills (as its 987 M fp32 runs are, for memory): its failure
    is a figure, recorded with how it ended, and the tool still exits 0 with ours."""
    fake = tmp_path / "dspython"
    # the warnings Python prints at exit come after the line that says what happened
    fake.write_text('#!/bin/sh\necho "fake deepspeed: out of memory" >&2\n'
                    'echo "resource_tracker.py:254: UserWarning: resource_tracker: leaked" >&2\n'
                    'echo "  warnings.warn(\'resource_tracker: There appear to be\')" >&2\n'
                    'kill -9 $$\n')
    fake.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    out = run_json(["bench_step.py", "--path", str(work), "--smoke", "--masters", "on",
                    "--rule", "adamw", "--deepspeed-python", str(fake)], tmp_path)
    assert out["settings"]["rule"] == "adamw"
    _check_bench_step_run(out["results"]["bf16_params_fp32_masters"], masters=True, rule="adamw")
    ds = out["results"]["deepspeed_zero_infinity_adamw_nvme_bf16"]
    assert "error" in ds and "out of memory" in "\n".join(ds["stderr_tail"]), ds
    sys.path.insert(0, str(TOOLS))
    try:
        from bench_all_report import headline
    finally:
        sys.path.remove(str(TOOLS))
    line = headline("step_x", out)
    assert "deepspeed_zero_infinity_adamw_nvme_bf16: failed (" in line and "out of memory" in line


def smoke_bench_step_deepspeed_adamw(tmp_path):
    """Ours all-AdamW (bf16 + masters) against DeepSpeed ZeRO-Infinity AdamW (bf16)."""
    out = run_json(["bench_step.py", "--path", str(tmp_path), "--smoke", "--masters", "on",
                    "--rule", "adamw", "--deepspeed-python", deepspeed_python()], tmp_path,
                   timeout=DEEPSPEED_TIMEOUT_S)
    _check_bench_step_run(out["results"]["bf16_params_fp32_masters"], masters=True, rule="adamw")
    ds = out["results"]["deepspeed_zero_infinity_adamw_nvme_bf16"]
    assert "error" not in ds, ds
    assert positive(*ds["training_peak_rss_bytes_per_rank"])
    assert ds["config"]["optimizer"]["type"] == "AdamW" and ds["config"]["bf16"]["enabled"]
    assert ds["config"]["zero_optimization"]["offload_param"]["device"] == "nvme"
    assert positive(ds["step_s"], ds["iteration_s"], *ds["peak_rss_bytes_per_rank"],
                    ds["ours_over_deepspeed"]["iteration"])


def smoke_bench_step_deepspeed(tmp_path):
    """Ours (fp32, no masters) and DeepSpeed ZeRO-3 Muon with NVMe offload on the same model."""
    out = run_json(["bench_step.py", "--path", str(tmp_path), "--smoke", "--masters", "off",
                    "--deepspeed-python", deepspeed_python()], tmp_path,
                   timeout=DEEPSPEED_TIMEOUT_S)
    _check_bench_step_run(out["results"]["fp32_params_no_masters"], masters=False)
    ds = out["results"]["deepspeed_zero3_muon_nvme"]
    assert "error" not in ds, ds
    assert positive(ds["step_s"], ds["iteration_s"]) and len(ds["step_s_runs"]) == 2


def _check_train_large(out: dict, rule: str, tmp_path):
    z = out["zeromuon"]
    assert "error" not in z and "error" not in out["compute_only"], (z, out["compute_only"])
    assert out["settings"]["rule"] == rule and z["params"] == out["params"]
    assert positive(z["step_s"], z["iteration_s"], z["compute_only_step_s"], z["io_s"], z["bound_s"],
                    z["step_over_bound"], z["state_bytes"], z["ram_bytes"],
                    *z["bytes_moved_per_rank"], *z["formula_bytes_per_rank"],
                    *z["peak_rss_bytes_per_rank"], out["fio"]["mixed"]["gbps"])
    # the pool keeps a few buckets between steps: never more than the formula moves
    assert all(0 < r <= 1 for r in z["moved_over_formula"])
    assert set(out["compute_only"]["probes"]) == {"1", "2"}
    assert not os.listdir(tmp_path)


def smoke_bench_train_large(tmp_path):
    """All-AdamW with the state on NVMe (bf16 params, fp32 masters), the in-memory probes and
    fio; no peer."""
    out = run_json(["bench_train_large.py", "--path", str(tmp_path), "--smoke", "--rule", "adamw"],
                   tmp_path)
    _check_train_large(out, "adamw", tmp_path)
    assert "deepspeed" not in out


def smoke_bench_train_large_deepspeed(tmp_path):
    """Muon rule, and DeepSpeed ZeRO-3 Muon with NVMe offload on the same model."""
    out = run_json(["bench_train_large.py", "--path", str(tmp_path), "--smoke", "--rule", "muon",
                    "--peer", "deepspeed", "--deepspeed-python", deepspeed_python()], tmp_path,
                   timeout=DEEPSPEED_TIMEOUT_S)
    _check_train_large(out, "muon", tmp_path)
    ds = out["deepspeed"]
    assert "error" not in ds, ds
    assert ds["config"]["optimizer"]["type"] == "Muon" and positive(ds["step_s"], ds["iteration_s"])


def smoke_bench_newton_schulz(tmp_path):
    out = run_json(["bench_newton_schulz.py", "--smoke"], tmp_path)
    assert set(out["per_shape"]) == {"attention (q, k, v, o)", "mlp up", "mlp down"}
    for m in out["per_shape"].values():
        assert positive(m["newton_schulz_s"], m["newton_schulz_gflops"], m["mm_gflops"])
    assert len(out["model_newton_schulz_s_per_rank"]) == 2
    assert positive(*out["model_newton_schulz_s_per_rank"])


def test_train_large_sizes_the_model_for_a_state_over_ram():
    """--state-over-ram R: the smallest shape whose state under the rule reaches R x RAM (the
    Muon rule's 8 B per matrix parameter needs a larger model than all-AdamW's 12 B)."""
    sys.path.insert(0, str(TOOLS))
    try:
        import bench_train_large as tl
    finally:
        sys.path.remove(str(TOOLS))
    vocab, ram = 32000, 25.3e9
    sizes = {}
    for rule in ("adamw", "muon"):
        params = tl.params_for_state(1.1 * ram, vocab, rule)
        state = tl.state_bytes_for(vocab, *tl.shape_for(params, vocab), rule)
        assert state >= 1.1 * ram
        assert tl.state_bytes_for(vocab, *tl.shape_for(params * 0.97, vocab), rule) < 1.1 * ram
        sizes[rule] = tl.decoder_params(vocab, *tl.shape_for(params, vocab))
    assert sizes["muon"] > sizes["adamw"]
    # by hand: 12 blocks of width 768 hold 12 x 12 x 768^2 matrix elements (8 B each on Muon)
    muon = 12 * 12 * 768 * 768
    assert tl.state_bytes_for(vocab, 768, 12, "muon") == 8 * muon + 12 * (
        tl.decoder_params(vocab, 768, 12) - muon)


def smoke_bench_all(tmp_path):
    """Two cheap benchmarks of --tiny run end to end: the JSON printed and written, the
    headline table, the machine and the commit recorded; DeepSpeed left out on purpose."""
    out_dir = tmp_path / "out"
    out = run_json(["bench_all.py", "--tiny", "--only", "io,startup", "--deepspeed-python", "",
                    "--path", str(tmp_path / "work"), "--out", str(out_dir)], tmp_path)
    assert json.loads((out_dir / "bench_all.json").read_text()) == out
    assert out["mode"] == "tiny" and len(out["git"]["commit"]) == 40
    machine = out["machine"]
    assert positive(machine["cores"], machine["ram_bytes"], machine["disk"]["free_bytes"])
    assert machine["cpu_model"] and "deepspeed" in out["missing"]
    assert list(out["benchmarks"]) == ["io", "startup"]
    for name, entry in out["benchmarks"].items():
        assert entry["status"] == "ok", entry
        assert entry["headline"] and "?" not in entry["headline"], entry["headline"]
        assert positive(entry["wall_s"]) and entry["result"]
    table = (out_dir / "bench_all.md").read_text()
    assert "| benchmark | latest result | date |" in table and "Measured: " in table
    assert all(f"| `{name}`" in table for name in out["benchmarks"])


def smoke_bench_all_resume(tmp_path):
    """A --full run takes hours: it is carried on in sittings. --resume keeps what finished
    (not run again), runs what --only names, marks the rest pending; the table says when each
    figure was measured; a run of another mode is refused."""
    out_dir = tmp_path / "out"
    base = ["bench_all.py", "--tiny", "--deepspeed-python", "", "--path", str(tmp_path / "work"),
            "--out", str(out_dir)]
    first = run_json(base + ["--only", "startup"], tmp_path)
    assert list(first["benchmarks"]) == ["startup"]
    second = run_json(base + ["--resume", "--only", "io"], tmp_path)
    entries = second["benchmarks"]
    assert entries["startup"] == first["benchmarks"]["startup"]   # kept, not run again
    assert entries["io"]["status"] == "ok" and entries["io"]["date"] >= entries["startup"]["date"]
    pending = {n for n, e in entries.items() if e["status"] == "pending"}
    assert pending == set(entries) - {"io", "startup"} and pending
    assert len(second["sessions"]) == 2 and second["date"] == first["date"]
    assert json.loads((out_dir / "bench_all.json").read_text()) == second
    table = (out_dir / "bench_all.md").read_text()
    assert "in 2 sessions" in table and "| `store`: " in table
    assert [line.endswith("| - |") for line in table.splitlines() if "pending" in line] == \
        [True] * len(pending)   # a benchmark not run yet has no date
    plan = run_json(base + ["--resume", "--dry-run"], tmp_path)["benchmarks"]
    assert plan["io"] == entries["io"] and "status" not in plan["store"]   # only the rest would run
    refused = subprocess.run([sys.executable, str(TOOLS / "bench_all.py"), "--quick", "--resume",
                              "--dry-run", "--out", str(out_dir), "--path", str(tmp_path / "work")],
                             capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S)
    assert refused.returncode != 0 and "--tiny run, not --quick" in refused.stderr


def smoke_bench_all_report(tmp_path):
    """The table rendered again from a run's JSON is the one the run wrote; a file that is
    not a report is refused with its name."""
    out_dir = tmp_path / "out"
    run(["bench_all.py", "--tiny", "--only", "startup", "--deepspeed-python", "", "--out",
         str(out_dir)], tmp_path)
    rendered = run(["bench_all_report.py", str(out_dir / "bench_all.json")], tmp_path).stdout
    assert rendered == (out_dir / "bench_all.md").read_text() and "| `startup`: " in rendered
    (tmp_path / "bad.json").write_text("[]")
    bad = subprocess.run([sys.executable, str(TOOLS / "bench_all_report.py"),
                          str(tmp_path / "bad.json")], capture_output=True, text=True,
                         timeout=SMOKE_TIMEOUT_S)
    assert bad.returncode == 2 and "bad.json" in bad.stderr


def smoke_bench_all_dry_run(tmp_path):
    """--full --dry-run prints the plan of issue 32's sizes and runs nothing; without fio on
    PATH the benchmarks that need it are skipped with why, and without DeepSpeed the peers."""
    bin_dir = tmp_path / "bin"   # a PATH with git and nothing else: no fio
    bin_dir.mkdir()
    (bin_dir / "git").symlink_to(shutil.which("git"))
    cmd = [sys.executable, str(TOOLS / "bench_all.py"), "--full", "--dry-run", "--path",
           str(tmp_path / "work"), "--deepspeed-python", ""]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S,
                          env={**os.environ, "PATH": str(bin_dir)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    plan = out["benchmarks"]
    assert out["dry_run"] and not (tmp_path / "work" / "io").exists()
    assert {"io", "store", "step_134m_muon", "step_134m_adamw", "step_1b_muon", "step_1b_adamw",
            "checkpoint", "consolidate_270m", "import_270m", "consolidate_2700m", "import_2700m",
            "inspect", "startup", "train_large_adamw", "train_large_muon"} == set(plan)
    assert "--dim 2048 --layers 17" in plan["step_1b_adamw"]["command"]
    assert "--params 3000000000.0" in plan["train_large_muon"]["command"]
    # the state must pass RAM on any machine: the Muon rule's model grows until it does
    assert "--state-over-ram 1.1" in plan["train_large_muon"]["command"]
    assert "make_deepspeed_checkpoint.py" in plan["consolidate_2700m"]["before"][-1]
    for name in ("store", "step_134m_muon", "consolidate_270m", "inspect"):
        assert plan[name]["status"] == "skipped" and "fio" in plan[name]["why"]
    assert "status" not in plan["io"] and "fio" in plan["io"]["peers_skipped"]
    assert "deepspeed" in plan["step_1b_muon"]["peers_skipped"]
    assert "--deepspeed-python" not in plan["step_1b_muon"]["command"]
    # an interpreter with deepspeed but without huggingface_hub (which zero_to_fp32 needs for
    # safetensors output): DeepSpeed runs beside the step, consolidate says why it runs alone
    fake = tmp_path / "dspython"
    fake.write_text('#!/bin/sh\ncase "$2" in *huggingface_hub*) echo "ModuleNotFoundError: '
                    'No module named huggingface_hub" >&2; exit 1;; esac\nexit 0\n')
    fake.chmod(0o755)
    proc = subprocess.run(cmd[:-1] + [str(fake)], capture_output=True, text=True,
                          timeout=SMOKE_TIMEOUT_S)
    plan = json.loads(proc.stdout)["benchmarks"]
    assert f"--deepspeed-python {fake}" in plan["step_1b_muon"]["command"]
    assert "huggingface_hub" in plan["consolidate_2700m"]["peers_skipped"]["zero_to_fp32"]
    assert "--deepspeed-python ''" in plan["consolidate_2700m"]["command"]


def smoke_bench_store(tmp_path):
    out = run_json(["bench_store.py", "--path", str(tmp_path), "--smoke"], tmp_path)
    assert positive(out["fio"]["mixed"]["gbps"], out["goal_wall_over_bound"])
    for setting in ("compute_bound", "io_bound"):
        s = out[setting]
        assert positive(s["median_wall_over_bound"], s["median_wall_s"], s["compute_per_bucket_s"])
        assert s["buckets"] > s["pool_buckets"] > 0
        assert s["bytes_per_step"]["exactly_one_read_and_write_of_each_non_resident"] is True
    assert not os.listdir(tmp_path)


def smoke_check_layers(tmp_path):
    """Already tiny: clean on this package (no output, exit 0), and it does refuse an upward
    import in a package planted with one."""
    proc = run(["check_layers.py"], tmp_path)
    assert proc.stdout == "" and proc.stderr == ""
    pkg = tmp_path / "offload_engine"
    for layer in ("io", "cli"):
        (pkg / layer).mkdir(parents=True)
        (pkg / layer / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "io" / "upward.py").write_text("from offload_engine.cli import main\n")
    bad = subprocess.run([sys.executable, str(TOOLS / "check_layers.py"), str(pkg)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "upward.py" in bad.stdout, bad.stdout + bad.stderr


def _gpu_check_functions() -> set[str]:
    """The check_* functions tools/gpu_check.py defines (each must be a section it runs)."""
    tree = ast.parse((TOOLS / "gpu_check.py").read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("check_")}


def smoke_gpu_check_py(tmp_path):
    """--smoke: every section at a tiny size. Without CUDA the CPU halves run and the CUDA
    sections say they were skipped; with CUDA every section runs."""
    import torch

    out = run_json(["gpu_check.py", "--path", str(tmp_path), "--smoke"], tmp_path)
    listed = [name for name in out if name != "machine"]
    assert {f"check_{name}" for name in listed} == _gpu_check_functions()   # none left out
    assert out["machine"]["size"] == "smoke" and out["machine"]["cuda"] == torch.cuda.is_available()
    for name in listed:
        assert "error" not in out[name], out[name]
    assert out["parity"]["bitwise"] is True
    assert all(positive(h["step_s"]) for h in out["step"]["homes"].values())
    if not torch.cuda.is_available():
        assert out["parity"]["device"] == "cpu" and set(out["step"]["homes"]) == {"nvme", "cpu"}
        assert out["copies"]["skipped"] == out["gpu_tier"]["skipped"] == "no CUDA"
    assert not os.listdir(tmp_path)


def smoke_gpu_check_sh(tmp_path):
    """The wrapper runs the script with the interpreter in PYTHON, passes its arguments on and
    writes the JSON to the file named (here --list: the sections, nothing run)."""
    target = tmp_path / "list.json"
    proc = subprocess.run(["bash", str(TOOLS / "gpu_check.sh"), str(target), "--list"],
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True,
                          text=True, timeout=SMOKE_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    listed = json.loads(target.read_text())
    assert json.loads(proc.stdout) == listed
    assert {f"check_{name}" for name in listed} == _gpu_check_functions()


def smoke_make_ds_checkpoint(tmp_path):
    from offload_engine.formats.deepspeed import DeepSpeedSource

    out = tmp_path / "ck"
    run(["make_ds_checkpoint.py", "--out", str(out), "--world", "2", "--smoke"], tmp_path,
        python=deepspeed_python(), timeout=DEEPSPEED_TIMEOUT_S)
    info = json.loads((out / "model_info.json").read_text())
    assert (info["vocab"], info["dim"], info["layers"], info["world"]) == (256, 64, 2, 2)
    with DeepSpeedSource(str(out)) as src:   # our reader takes what DeepSpeed wrote
        assert (src.world_size, src.stage) == (2, 3)
        assert sum(t.numel for t in src.tensors() if t.kind == "param") == info["params"]


def smoke_make_deepspeed_checkpoint(tmp_path):
    """A tiny generated ZeRO-3 checkpoint (W=2): our reader takes it, every parameter there."""
    from offload_engine.formats.deepspeed import DeepSpeedSource

    out = run_json(["make_deepspeed_checkpoint.py", "--out", str(tmp_path / "ck"), "--smoke"],
                   tmp_path)
    assert (out["world_size"], out["tensors"]) == (2, 21) and positive(out["bytes_written"])
    with DeepSpeedSource(out["out"]) as src:
        assert (src.world_size, src.stage) == (2, 3)
        assert sum(t.numel for t in src.tensors() if t.kind == "param") == out["params"]


def smoke_make_deepspeed_moe_fixtures(tmp_path):
    """One native-MoE run (ZeRO-1, expert-parallel size 1, 2 ranks) made again into a scratch
    folder: our reader consolidates it to the fp32 masters DeepSpeed recorded beside it."""
    from safetensors.torch import load_file

    from offload_engine.consolidate import get_fp32_state_dict

    run(["make_deepspeed_moe_fixtures.py", "--out", str(tmp_path), "zero1_ep1_w2_fp32"], tmp_path,
        python=deepspeed_python(), timeout=DEEPSPEED_TIMEOUT_S)
    made = tmp_path / "zero1_ep1_w2_fp32"
    expected = load_file(str(made / "expected.safetensors"))
    masters = {k.split("/", 1)[1]: v for k, v in expected.items() if k.startswith("master/")}
    state = get_fp32_state_dict(str(made))
    assert masters and all(state[k].equal(v) for k, v in masters.items())


def smoke_regen_cli_help(tmp_path):
    """--check: every usage block in docs/cli.md is what the command prints (exit 0)."""
    run(["regen_cli_help.py", "--check"], Path(ROOT))


# -- the cases: "<tool file>" or "<tool file>[variant]" -> (check, marks) ---------------------
CASES = {
    "bench_all.py": (smoke_bench_all, []),
    "bench_all.py[dry-run]": (smoke_bench_all_dry_run, []),
    "bench_all.py[resume]": (smoke_bench_all_resume, []),
    "bench_all_report.py": (smoke_bench_all_report, []),
    "bench_checkpoint.py": (smoke_bench_checkpoint, [needs_fio]),
    "bench_consolidate.py": (smoke_bench_consolidate, [needs_fio, needs_time]),
    "bench_consolidate.py[deepspeed]": (smoke_bench_consolidate_deepspeed,
                                        [needs_fio, needs_time, *deepspeed_case]),
    "bench_import.py": (smoke_bench_import, [needs_fio, needs_time]),
    "bench_inspect.py": (smoke_bench_inspect, [needs_fio]),
    "bench_many_tensors.py": (smoke_bench_many_tensors, []),
    "bench_newton_schulz.py": (smoke_bench_newton_schulz, []),
    "bench_io.py": (smoke_bench_io, []),
    "bench_startup.py": (smoke_bench_startup, []),
    "bench_step.py": (smoke_bench_step, [needs_fio]),
    "bench_step.py[adamw]": (smoke_bench_step_adamw, [needs_fio]),
    "bench_step.py[deepspeed]": (smoke_bench_step_deepspeed, [needs_fio, *deepspeed_case]),
    "bench_step.py[deepspeed-adamw]": (smoke_bench_step_deepspeed_adamw,
                                       [needs_fio, *deepspeed_case]),
    "bench_train_large.py": (smoke_bench_train_large, [needs_fio]),
    "bench_train_large.py[deepspeed]": (smoke_bench_train_large_deepspeed,
                                        [needs_fio, *deepspeed_case]),
    "bench_store.py": (smoke_bench_store, [needs_fio]),
    "check_layers.py": (smoke_check_layers, []),
    "gpu_check.py": (smoke_gpu_check_py, []),
    "gpu_check.sh": (smoke_gpu_check_sh, []),
    "make_ds_checkpoint.py[deepspeed]": (smoke_make_ds_checkpoint, deepspeed_case),
    "make_deepspeed_checkpoint.py": (smoke_make_deepspeed_checkpoint, []),
    "make_deepspeed_moe_fixtures.py[deepspeed]": (smoke_make_deepspeed_moe_fixtures,
                                                  deepspeed_case),
    "regen_cli_help.py": (smoke_regen_cli_help, []),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", [pytest.param(name, marks=marks, id=name)
                                  for name, (_check, marks) in CASES.items()])
def test_tool_smoke(case, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    CASES[case][0](work)


def test_every_tool_has_a_smoke_case():
    """A new tool in tools/ fails here until it has a case above (and a case for a tool that
    is gone fails too)."""
    tools = {p.name for p in TOOLS.iterdir() if p.suffix in (".py", ".sh")}
    covered = {name.split("[")[0] for name in CASES}
    assert tools - covered == set(), "tools without a smoke case"
    assert covered - tools == set(), "smoke cases for tools that are gone"


def test_a_benchmark_needs_room_for_its_input_only_while_that_is_to_be_made(tmp_path):
    """The 2.7 B checkpoint (32 GB) is made by whichever of consolidate and import runs first:
    each must count it while it is not there, and not count it twice once it is (the import
    was skipped for 43 GB it did not need, beside the checkpoint already made)."""
    sys.path.insert(0, str(TOOLS))
    try:
        import bench_all
    finally:
        sys.path.remove(str(TOOLS))
    free = shutil.disk_usage(tmp_path).free
    b = bench_all.Bench("import_x", "t", [], disk_bytes=free // 2,
                        input_dir="{path}/ds_x", input_bytes=free // 2 + (1 << 30))
    assert "GB free at --path" in bench_all.too_little_disk(b, str(tmp_path))
    (tmp_path / "ds_x").mkdir()
    (tmp_path / "ds_x" / "latest").write_text("global_step2")
    assert bench_all.too_little_disk(b, str(tmp_path)) is None


def test_a_peer_that_dies_after_printing_its_figures_keeps_them():
    """DeepSpeed's AIO threads can abort the interpreter on its way out (SIGABRT) after the
    worker printed its figures: the benchmark reports them and how the process ended, and
    a worker that printed nothing is still an error."""
    sys.path.insert(0, str(TOOLS))
    try:
        import bench_step
    finally:
        sys.path.remove(str(TOOLS))
    out = bench_step.worker_result(-6, 'log\nBENCH_RESULT {"ranks": [1]}\n', "terminate called\nAborted", 60)
    assert out["ranks"] == [1]
    assert out["exit_after_result"] == {"exit_code": -6, "stderr_tail": ["terminate called", "Aborted"]}
    failed = bench_step.worker_result(-6, "log\n", "Aborted", 60)
    assert failed["error"] == "exit code -6" and failed["stderr_tail"] == ["Aborted"]
    assert "error" in bench_step.worker_result(None, "", "", 60)  # timed out
    assert bench_step.worker_result(0, 'BENCH_RESULT {"ranks": [2]}', "", 60) == {"ranks": [2]}
