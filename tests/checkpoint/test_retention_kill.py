"""keep_last under kill -9: a real writer process saving with keep_last=2 is killed by
SIGKILL at random moments and at fixed points inside retention (before the rename to
``.deleting``, between it and the removal, half way through the removal). After every
kill the generation ``latest`` names loads, with the parameters it was saved with; the
next save finishes the interrupted removal."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from offload_engine.checkpoint import CheckpointError, load_checkpoint, resolve, save_checkpoint
from offload_engine.optim import ZeroMuon

from helpers.paths import child_env

WRITER = textwrap.dedent("""
    import os, signal, sys, torch
    from helpers.forged import fresh_model
    from offload_engine.checkpoint import retention, save_checkpoint
    ck, state, point = sys.argv[1], sys.argv[2], sys.argv[3]
    model, opt = fresh_model(state)

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    class Dying:  # retention's file system calls, with a kill -9 at the chosen point
        def __getattr__(self, name):
            return getattr(real, name)
        def rename(self, src, dst):
            if point == "before-rename":
                die()
            real.rename(src, dst)
        def rmtree(self, path):
            if point == "before-rmtree" and path.endswith(".deleting"):
                die()
            if point == "mid-rmtree" and path.endswith(".deleting"):
                files = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)
                for f in files[:len(files) // 2]:
                    os.unlink(f)
                die()
            real.rmtree(path)
    real = retention.syscalls
    if point != "random":
        retention.syscalls = Dying()
    print("ready", flush=True)
    for step in range(1, 10_000):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.01 * step)
        opt.step()
        want = {{n: p.detach().clone() for n, p in model.named_parameters()}}
        torch.save(want, os.path.join(ck, ".expected.tmp"))
        os.replace(os.path.join(ck, ".expected.tmp"), os.path.join(ck, f"expected-{{step}}.pt"))
        save_checkpoint(ck, model, opt, step, keep_last=2)
""")


def run_writer(ck, state, point, delay):
    proc = subprocess.Popen([sys.executable, "-c", WRITER.format(), str(ck), str(state), point],
                            stdout=subprocess.PIPE, text=True, env=child_env())
    assert proc.stdout.readline().strip() == "ready"
    if point == "random":
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=120)
    assert proc.returncode == -signal.SIGKILL


def check_loadable(ck, tmp_path, trial):
    from helpers.forged import fresh_model
    gen = resolve(str(ck))  # raises if latest names nothing loadable
    step = int(os.path.basename(gen).split("-")[1])
    expected = torch.load(ck / f"expected-{step}.pt")
    model, opt = fresh_model(str(tmp_path / f"load-{trial}"), seed=3)
    assert load_checkpoint(str(ck), model, opt) == step
    for n, p in model.named_parameters():
        assert torch.equal(p, expected[n]), (trial, n, step)
    opt.close()
    return step


@pytest.mark.multiprocess
@pytest.mark.parametrize("point", ["before-rename", "before-rmtree", "mid-rmtree"])
def test_kill_inside_retention_never_loses_the_loadable_generation(tmp_path, point):
    ck = tmp_path / "ck"
    ck.mkdir()
    run_writer(ck, tmp_path / "state", point, 0)
    # the third save is the first that removes one: it is committed, the kill came after
    step = check_loadable(ck, tmp_path, point)
    assert step == 3
    gens = sorted(p.name for p in ck.iterdir() if p.name.startswith("step-"))
    if point == "before-rename":
        assert gens == ["step-00000001", "step-00000002", "step-00000003"]
    else:
        assert gens == ["step-00000001.deleting", "step-00000002", "step-00000003"]
        with pytest.raises(CheckpointError, match="being removed by keep_last"):
            resolve(str(ck), "step-00000001.deleting")
    # the next save (another process: a resumed run) finishes the removal
    from helpers.forged import fresh_model
    model, opt = fresh_model(str(tmp_path / "resumed"))
    load_checkpoint(str(ck), model, opt)
    save_checkpoint(str(ck), model, opt, 4, keep_last=2)
    opt.close()
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step-")) == \
        ["step-00000003", "step-00000004"]


@pytest.mark.multiprocess
def test_kill_9_at_random_moments_with_keep_last(tmp_path):
    rng = random.Random(7)
    steps = []
    for trial in range(8):
        ck = tmp_path / f"ck{trial}"
        ck.mkdir()
        run_writer(ck, tmp_path / f"state{trial}", "random", rng.uniform(0.1, 1.5))
        try:
            resolve(str(ck))
        except CheckpointError:
            assert not (ck / "latest").exists()  # killed before the first commit
            continue
        steps.append(check_loadable(ck, tmp_path, trial))
        committed = [p for p in ck.iterdir() if p.name.startswith("step-")
                     and not p.name.endswith((".partial", ".deleting"))]
        assert len(committed) <= 3  # keep_last=2, and one more while its successor commits
    print("loaded steps", steps)
    assert steps, "no trial got as far as a commit"
