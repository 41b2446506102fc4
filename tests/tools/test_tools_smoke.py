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


def _check_bench_step_run(run: dict, masters: bool):
    assert "error" not in run, run
    assert positive(run["nvme_step_s"], run["cpu_step_s"], run["ratio_nvme_over_bound"],
                    run["ratio_nvme_over_cpu"], run["io_s"], run["io_bytes_per_step_all_ranks"])
    assert run["world"] == len(run["per_rank"]) == 2
    for rank in run["per_rank"]:
        kinds = {"muon_momentum", "adam_moments"} | ({"masters"} if masters else set())
        assert set(rank["bytes_per_param"]) == kinds
        assert positive(rank["moved_bytes"], rank["bundles"], rank["pool_bytes"])
        assert rank["pool_bytes"] < rank["state_bytes"]   # the state streams, as in a real run


def smoke_bench_step(tmp_path):
    out = run_json(["bench_step.py", "--path", str(tmp_path), "--smoke", "--masters", "on"], tmp_path)
    assert set(out["results"]) == {"bf16_params_fp32_masters"}
    _check_bench_step_run(out["results"]["bf16_params_fp32_masters"], masters=True)
    assert positive(out["fio"]["mixed"]["gbps"])
    assert not os.listdir(tmp_path)


def smoke_bench_step_deepspeed(tmp_path):
    """Ours (fp32, no masters) and DeepSpeed ZeRO-3 Muon with NVMe offload on the same model."""
    out = run_json(["bench_step.py", "--path", str(tmp_path), "--smoke", "--masters", "off",
                    "--deepspeed-python", deepspeed_python()], tmp_path,
                   timeout=DEEPSPEED_TIMEOUT_S)
    _check_bench_step_run(out["results"]["fp32_params_no_masters"], masters=False)
    ds = out["results"]["deepspeed_zero3_muon_nvme"]
    assert "error" not in ds, ds
    assert positive(ds["step_s"], ds["iteration_s"]) and len(ds["step_s_runs"]) == 2


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
    "bench_checkpoint.py": (smoke_bench_checkpoint, [needs_fio]),
    "bench_consolidate.py": (smoke_bench_consolidate, [needs_fio, needs_time]),
    "bench_consolidate.py[deepspeed]": (smoke_bench_consolidate_deepspeed,
                                        [needs_fio, needs_time, *deepspeed_case]),
    "bench_import.py": (smoke_bench_import, [needs_fio, needs_time]),
    "bench_inspect.py": (smoke_bench_inspect, [needs_fio]),
    "bench_io.py": (smoke_bench_io, []),
    "bench_startup.py": (smoke_bench_startup, []),
    "bench_step.py": (smoke_bench_step, [needs_fio]),
    "bench_step.py[deepspeed]": (smoke_bench_step_deepspeed, [needs_fio, *deepspeed_case]),
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
