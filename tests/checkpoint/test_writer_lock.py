"""One writer per checkpoint folder (issue 30, item 2): two real trainings pointed at one
checkpoint folder. The second is refused at its first save with a message naming the first's
pid and host, and writes nothing; a reader is not blocked while the first holds the folder;
every generation the first saved loads bit for bit; once the first has exited (or been
killed with SIGKILL) a new run saves there without any manual step."""

from __future__ import annotations

import fcntl
import itertools
import os
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from offload_engine.checkpoint import load_checkpoint, resolve
from offload_engine.layout.checkpoint_names import WRITER_LOCK

from helpers.forged import fresh_model
from helpers.paths import child_env

TRAINING = textwrap.dedent("""
    import os, sys, torch
    from helpers.forged import fresh_model
    from offload_engine.checkpoint import CheckpointLockedError, load_checkpoint, save_checkpoint
    ck, state, expected, first, last, resume = sys.argv[1:7]
    model, opt = fresh_model(state, seed=int(first))
    if resume == "1":
        load_checkpoint(ck, model, opt)
    for step in range(int(first), int(last) + 1):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.01 * step)
        opt.step()
        want = {n: p.detach().clone() for n, p in model.named_parameters()}
        torch.save(want, os.path.join(expected, f"{step}.pt"))
        try:
            save_checkpoint(ck, model, opt, step, keep_last=3)
        except CheckpointLockedError as e:
            print("refused", e, flush=True)
            sys.exit(3)
        print("saved", step, flush=True)
    print("holding", flush=True)
    sys.stdin.readline()            # the parent says when this run ends
    opt.close()
""")

TIMEOUT_S = 120
_loads = itertools.count()  # a fresh store folder per load


class Training:
    """A training process saving steps ``first``..``last`` into ``ck``; its output lines
    arrive on a queue (a reader thread), so that every wait has a deadline."""

    def __init__(self, ck, tmp, name: str, first: int, last: int, resume: bool = False):
        expected = tmp / "expected"
        expected.mkdir(exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", TRAINING, str(ck), str(tmp / f"state-{name}"), str(expected),
             str(first), str(last), "1" if resume else "0"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=child_env())
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, word: str) -> str:
        seen = []
        while True:
            try:
                line = self.lines.get(timeout=TIMEOUT_S)
            except queue.Empty:
                self.proc.kill()
                raise AssertionError(f"no {word!r} within {TIMEOUT_S} s; output: {seen}")
            if line is None:
                raise AssertionError(f"exited ({self.proc.wait()}) before {word!r}: {seen}")
            seen.append(line)
            if line.startswith(word):
                return line

    def end(self, how: str) -> int:
        if how == "sigkill":
            self.proc.send_signal(signal.SIGKILL)
        else:
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
        return self.proc.wait(timeout=TIMEOUT_S)


def loads_bit_exact(ck, tmp, tag, step: int) -> None:
    """Generation ``tag`` (``latest`` when None) loads, at ``step``, with the parameters the
    writer recorded just before saving it."""
    want = torch.load(tmp / "expected" / f"{step}.pt")
    model, opt = fresh_model(str(tmp / f"load-{next(_loads)}"), seed=99)
    try:
        assert load_checkpoint(str(ck), model, opt, tag) == step
        for n, p in model.named_parameters():
            assert torch.equal(p, want[n]), (tag, n)
    finally:
        opt.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize("first_ends", ["exit", "sigkill"])
def test_second_training_is_refused_and_the_first_generations_survive(tmp_path, first_ends):
    ck = tmp_path / "ck"
    first = Training(ck, tmp_path, "first", 1, 3)
    first.wait_for("holding")

    # a reader while the folder is held: not blocked (a thread with a deadline), bit exact
    done = []
    reader = threading.Thread(target=lambda: done.append(loads_bit_exact(ck, tmp_path, None, 3)))
    reader.start()
    reader.join(TIMEOUT_S)
    assert done, "load_checkpoint did not return while another process held the writer lock"

    before = sorted(os.listdir(ck))
    second = Training(ck, tmp_path, "second", 1, 2)  # a zombie's twin: the same step names
    refused = second.wait_for("refused")
    assert second.proc.wait(timeout=TIMEOUT_S) == 3
    assert f"process {first.proc.pid} on {socket.gethostname()!r}" in refused, refused
    assert "since" in refused and str(ck) in refused, refused
    assert sorted(os.listdir(ck)) == before  # refused before anything was written
    assert os.path.basename(resolve(str(ck))) == "step-00000003"
    for step in (1, 2, 3):
        loads_bit_exact(ck, tmp_path, f"step-{step:08d}", step)

    # the holder goes away (its flock with it): a new run takes the folder, no manual step
    code = first.end(first_ends)
    assert code == (-signal.SIGKILL if first_ends == "sigkill" else 0)
    assert (ck / WRITER_LOCK).is_file()  # left behind, and harmless
    third = Training(ck, tmp_path, "third", 4, 5, resume=True)
    third.wait_for("holding")
    assert third.end("exit") == 0
    for step in (3, 4, 5):  # keep_last=3
        loads_bit_exact(ck, tmp_path, f"step-{step:08d}", step)
    loads_bit_exact(ck, tmp_path, None, 5)
    assert sorted(p for p in os.listdir(ck) if p.startswith("step-")) == \
        ["step-00000003", "step-00000004", "step-00000005"]


def save_at_w2(rank, world, mesh, tmp):
    """Both ranks of one job save into ``ok`` (rank 0 holds it, rank 1 is not refused), then
    into ``held``, which another job's rank 0 holds: every rank is refused, naming it."""
    import torch.distributed as dist
    from offload_engine.checkpoint import CheckpointLockedError, save_checkpoint
    from helpers.checkpoint_runs import mixed_model
    model, _, opt, _ = mixed_model(mesh, 0, os.path.join(tmp, f"state{rank}"))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    for step in (1, 2):
        save_checkpoint(os.path.join(tmp, "ok"), model, opt, step)
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    with open(os.path.join(tmp, "ok", WRITER_LOCK)) as f:
        assert f"{pids[0]}" in f.read()  # the job's rank 0 holds it for every rank
    try:
        save_checkpoint(os.path.join(tmp, "held"), model, opt, 3)
    except CheckpointLockedError as e:
        assert "process 4242 on 'node7'" in str(e), str(e)
    else:
        raise AssertionError(f"rank {rank}: a folder held by another job was saved into")
    opt.close()


@pytest.mark.multiprocess
def test_the_ranks_of_one_job_share_the_lock_and_another_job_is_refused_on_every_rank(tmp_path):
    from helpers.zero_muon_harness import spawn
    held = tmp_path / "held"
    held.mkdir()
    fd = os.open(held / WRITER_LOCK, os.O_RDWR | os.O_CREAT, 0o644)  # the other job's rank 0
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b'{"pid": 4242, "host": "node7", "since": "2026-12-04 01:02:03 UTC"}')
        spawn(2, save_at_w2, str(tmp_path))
    finally:
        os.close(fd)
    assert sorted(os.listdir(held)) == [WRITER_LOCK]  # nothing written by the refused job
    assert os.path.basename(resolve(str(tmp_path / "ok"))) == "step-00000002"


def test_a_staging_folder_replaced_by_another_writer_is_never_committed(tmp_path, monkeypatch):
    """Where no lock guards the folder (a file system that cannot lock), a second writer's
    clean-up may remove this save's ``.partial`` and make its own: the commit sees that the
    folder is no longer the one it made and refuses, instead of committing the other
    writer's files as this generation."""
    from offload_engine.checkpoint import CheckpointError, save_checkpoint
    from offload_engine.checkpoint import save as save_module
    from helpers.forged import train
    ck = str(tmp_path / "ck")
    model, opt = fresh_model(str(tmp_path / "state"))
    train(model, opt, [1])
    save_checkpoint(ck, model, opt, 1)
    real = save_module.wait_for_ranks

    def other_writer_meanwhile(staging, world, timeout_s):
        summaries = real(staging, world, timeout_s)
        import shutil
        shutil.rmtree(staging)                               # its prepare_staging
        os.makedirs(os.path.join(staging, "rank0"))          # and its own save, done
        with open(os.path.join(staging, "rank0", ".done.json"), "w") as f:
            f.write("{}")
        return summaries
    monkeypatch.setattr(save_module, "wait_for_ranks", other_writer_meanwhile)
    train(model, opt, [2])
    with pytest.raises(CheckpointError, match="replaced by another writer.*not committed"):
        save_checkpoint(ck, model, opt, 2)
    opt.close()
    assert os.path.basename(resolve(ck)) == "step-00000001"
    assert not os.path.exists(os.path.join(ck, "step-00000002"))


@pytest.mark.parametrize("where", ["_write_note", "WriterLock"])
def test_a_signal_while_the_lock_is_taken_leaves_the_next_save_of_this_process_free(
        tmp_path, monkeypatch, where):
    """SIGTERM's SystemExit (or Ctrl-C) landing after the flock but before the lock is
    listed: the usual handler then saves once more, from this same process. That save must
    not be refused by the lock the interrupted one took ("already being written by process
    <this one>": a signal trial in CI ended so, with no checkpoint at all)."""
    from offload_engine.checkpoint import save_checkpoint
    from offload_engine.checkpoint import writer_lock
    from helpers.forged import train
    ck = str(tmp_path / "ck")
    model, opt = fresh_model(str(tmp_path / "state"))
    train(model, opt, [1])
    real = getattr(writer_lock, where)
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(where)
        if len(calls) == 1:
            raise SystemExit(143)                     # as the trial's SIGTERM handler raises
        return real(*args, **kwargs)
    monkeypatch.setattr(writer_lock, where, interrupted)
    with pytest.raises(SystemExit):
        save_checkpoint(ck, model, opt, 1)
    save_checkpoint(ck, model, opt, 1, tag="interrupt-1")   # the handler's save
    opt.close()
    assert len(calls) == 2
    assert os.path.basename(resolve(ck)) == "interrupt-1"
    with open(os.path.join(ck, WRITER_LOCK), "rb") as f:  # and no descriptor keeps it locked
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
