"""The scripts in examples/ run as the docs say: real torchrun subprocesses."""

import os
import re
import subprocess
import sys
import time

import pytest

from helpers.paths import ROOT

EXAMPLE = os.path.join(ROOT, "examples", "train_fsdp2.py")


@pytest.mark.multiprocess
def test_train_fsdp2_under_torchrun_streams_state_and_the_loss_falls(tmp_path):
    store = tmp_path / "state"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           EXAMPLE, "--store", str(store)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = re.findall(r"step +(\d+)  loss ([0-9.]+)  nvme read (\d+) B  written (\d+) B", proc.stdout)
    assert len(rows) >= 3, proc.stdout
    losses = [float(r[1]) for r in rows]
    assert losses[-1] < 0.25 * losses[0], losses
    assert int(rows[-1][2]) > 0 and int(rows[-1][3]) > 0, "the state should stream from NVMe"
    for r in range(2):   # one store per rank, each with its arrays on disk
        assert (store / f"rank{r}" / "muon_momentum" / "zarr.json").exists()  # one level


@pytest.mark.multiprocess
def test_train_fsdp2_saves_is_killed_resumes_bitwise_and_consolidates(tmp_path):
    """The journey of docs/optimizer.md with the example alone: a run with --checkpoint is
    SIGKILLed mid-way; the same command again resumes from its latest checkpoint (whatever
    the crash left in --store), finishes, and its consolidated weights equal an uninterrupted
    run's bit for bit. Without a checkpoint, a used --store is refused in one line."""
    import signal

    import psutil
    from safetensors.torch import load_file

    def command(name, *extra):
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", EXAMPLE, "--store", str(tmp_path / f"state-{name}"),
                "--steps", "20", "--save-every", "5", *extra]
    env = {**os.environ, "PYTHONPATH": ROOT}
    ref = subprocess.run(command("ref", "--checkpoint", str(tmp_path / "ck-ref")), cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env=env)
    assert ref.returncode == 0, ref.stderr[-4000:]

    run = command("run", "--checkpoint", str(tmp_path / "ck-run"))
    latest = tmp_path / "ck-run" / "latest"
    proc = subprocess.Popen(run, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env, start_new_session=True)
    try:                                  # killed as soon as the save of step 10 is committed
        deadline = time.monotonic() + 240
        while not (latest.exists() and latest.read_text().strip() >= "step-00000010"):
            assert proc.poll() is None and time.monotonic() < deadline, "no save of step 10"
            time.sleep(0.02)
        # torchrun starts its workers in sessions of their own: kill each, as a crash would
        for p in psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]:
            p.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    again = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert again.returncode == 0, again.stderr[-4000:]
    resumed = re.search(r"resumed from .*step-0*(\d+) \(step (\d+)\)", again.stdout)
    assert resumed and int(resumed.group(2)) in (10, 15), again.stdout

    cli = [sys.executable, "-m", "offload_engine.cli.main", "consolidate"]
    for name in ("ref", "run"):
        out = subprocess.run(cli + [str(tmp_path / f"ck-{name}"), str(tmp_path / f"out-{name}")],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
    a = load_file(str(tmp_path / "out-ref" / "model.safetensors"))
    b = load_file(str(tmp_path / "out-run" / "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)

    fresh = subprocess.run(command("run"), cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env=env)
    assert fresh.returncode != 0
    ours = [line for line in fresh.stderr.splitlines() if line.startswith("train_fsdp2.py: ")]
    assert len(ours) == 1 and "earlier run" in ours[0], fresh.stderr[:2000]   # rank 0 only
    assert "pass --checkpoint" in fresh.stderr
    assert "InputError" not in fresh.stderr   # no worker traceback (torchrun adds its own summary)


def test_the_optimizer_doc_shows_the_example_verbatim():
    with open(EXAMPLE) as f:
        script = f.read()
    with open(os.path.join(ROOT, "docs", "optimizer.md")) as f:
        doc = f.read()
    assert f"```python\n{script}```" in doc


@pytest.mark.multiprocess
def test_expert_parallel_example_trains_and_its_checkpoint_consolidates_per_expert(tmp_path):
    """examples/train_moe_ep.py under torchrun (2 processes): whole experts per rank
    (Shard(0) on the expert dimension), tokens routed by all_to_all, every expert on Muon;
    the loss falls, and the expert-parallel checkpoint consolidates on one process into one
    tensor per expert."""
    from safetensors import safe_open
    example = os.path.join(ROOT, "examples", "train_moe_ep.py")
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           example, "--store", str(tmp_path / "state"), "--checkpoint", str(ckpt), "--steps", "21"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = re.findall(r"step +(\d+)  loss ([0-9.]+)  all_to_all \(Muon\) (\d+) B", proc.stdout)
    losses = [float(r[1]) for r in rows]
    assert len(losses) == 3 and losses[-1] < 0.5 * losses[0], proc.stdout
    cli = [sys.executable, "-m", "offload_engine.cli.main"]
    proc = subprocess.run(cli + ["consolidate", str(ckpt), str(out), "--experts", "per-expert"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    for layer in range(2):
        for w in ("w1", "w2", "w3"):
            assert not any(n.endswith(f"layers.{layer}.moe.experts.{w}") for n in names)
        assert sum(f".layers.{layer}.moe.experts." in f".{n}" for n in names) == 12, names
    proc = subprocess.run(cli + ["inspect", str(ckpt), "--json"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert '"layers.0.moe.experts.w1"' in proc.stdout
