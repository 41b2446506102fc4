"""Power loss: real saves, their file-system calls recorded (io/syscalls.py's recorder,
tests/helpers/fs_trace.py), replayed under the pessimistic model (tests/helpers/power_cut.py:
a file's data is durable only after its fsync, a directory entry only after its parent's
fsync) with a power cut after every call. At every point ``latest`` names only durable
generations, and a restart finds every generation a save reported committed to its caller.
Then each fsync site of the save path is left out in turn (every call it made): the model
must report a violation, or, for a file or folder fsynced at two sites (by its writer, then
again before the commit), must report one once both are left out. Only the fsyncs of
fsyncs in ``NOT_NEEDED`` are not (files removed before the commit, folders the commit
fsyncs again), and the test checks that they are recorded and idle.

Saves: W=1 blocking and async, W=2 (two processes, gloo) blocking and async, all with
``keep_last`` removing generations, into a checkpoint folder two levels below a directory
that exists (the first save creates both levels: issue 30, item 8).
"""

from __future__ import annotations

import errno
import os
import re

import pytest
import torch.distributed as dist

from offload_engine.checkpoint import checkpoint_dir, save_checkpoint, save_checkpoint_async
from offload_engine.formats.errors import CheckpointSaveError
from offload_engine.layout.checkpoint_names import generation_name
from offload_engine.optim import ZeroMuon

from helpers.checkpoint_runs import ADAMW, MUON, store
from helpers.fs_trace import FsTrace, read_log
from helpers.power_cut import idle_syncs, live_names, replay, sync_sites
from helpers.zero_muon_harness import make_pair, set_grads, spawn

SHAPES = {"w_mat": (16, 8), "w_odd": (5, 7), "norm_weight": (8,), "lm_head": (4, 8)}
CKPT = os.path.join("ckpt", "run")   # under the traced root; the first save makes both levels
SAVES = 3
KEEP_LAST = 2
COMMIT_PAUSE_S = 0.5   # rank 0 at W=2, after its commit renames (polls take 0.05 s)

def ALWAYS(world: int, mode: str) -> bool:
    return True


RANKS = r".*/<gen>\.partial/rank\{r\}$"
RANK_FOLDER = "a rank's folder: the commit fsyncs it after removing the rank's report"
# The fsyncs on the save path that no power cut needs, and why; each is checked to be
# recorded and idle in the runs named (so removing one fails the test too, as a stale list).
# The others are each needed: leaving one out is a violation.
NOT_NEEDED = {  # pattern of the site: (why, the runs that make it: world size, mode)
    r"for checkpoint\.checkpoint_dir\.report_done: .*\.done\.json":
        ("a rank's report to rank 0: removed before the commit", ALWAYS),
    r"for checkpoint\.shared_dir\.write_marker: ":
        ("the marker that shows every rank sees the folder: removed before the commit, "
         "which fsyncs the folder", lambda world, mode: world > 1),
    r"fsync_dir for checkpoint\.save\.save_checkpoint_async: " + RANKS: (RANK_FOLDER, ALWAYS),
    r"fsync_dir for checkpoint\.rank_writer\._create: " + RANKS: (RANK_FOLDER, ALWAYS),
    r"fsync_dir for checkpoint\.checkpoint_dir\.report_done: " + RANKS: (RANK_FOLDER, ALWAYS),
    r"sync_tree for checkpoint\.rank_writer\.finish: " + RANKS: (RANK_FOLDER, ALWAYS),
    r"for checkpoint\.checkpoint_dir\.report_failed: ":
        ("a failed save's report, in a folder never committed", lambda world, mode:
         mode == "orphan"),
    r"fsync_dir for checkpoint\.checkpoint_dir\.set_aside_orphan: ":
        ("the orphan left under its name is a whole committed generation latest does not "
         "name; the commit's fsync of the folder orders the two renames",
         lambda world, mode: mode == "orphan"),
    r"fsync_dir for checkpoint\.checkpoint_dir\.write_latest: ":
        ("at W=2 rank 1 fsyncs the folder once latest names the generation, here (the "
         "test pauses rank 0) before rank 0 does and before either save returns; needed "
         "at W=1", lambda world, mode: world > 1),
}


def run_saves(tmp: str, rank: int, world: int, mesh, mode: str) -> None:
    """Train a tiny model, saving after each step (``mode``: "blocking"; "async": the next
    step runs while the save is written; "orphan": blocking, and the first save of step 2
    fails after its commit rename, before ``latest``, so that its second save sets the
    orphan aside), and mark each save that returned as committed."""
    model, ref = make_pair(SHAPES, mesh, seed=3)
    opt = ZeroMuon(model.named_parameters(), **MUON, adamw=ADAMW,
                   store=store(os.path.join(tmp, f"store-{mode}-{rank}")))
    root = os.path.join(tmp, "disk")
    ckpt = os.path.join(root, CKPT)
    with FsTrace(root, os.path.join(tmp, f"trace-{mode}.log"), pause_after_commit) as trace:
        for step in range(1, SAVES + 1):
            set_grads(model, ref, step, rank, world)
            opt.step()
            if mode == "orphan" and step == 2:
                _commit_without_latest(ckpt, model, opt, step)
            if mode in ("blocking", "orphan"):
                save_checkpoint(ckpt, model, opt, step, keep_last=KEEP_LAST)
            else:
                pending = save_checkpoint_async(ckpt, model, opt, step, keep_last=KEEP_LAST)
                set_grads(model, ref, 100 + step, rank, world)
                opt.step()  # waits for the parameters to be written, not for the commit
                pending.wait()
            trace.mark("committed", generation=generation_name(step), rank=rank)
    opt.close()


def _commit_without_latest(ckpt: str, model, opt, step: int) -> None:
    """A save of ``step`` whose write of ``latest`` fails (as a crash there would leave
    it): the generation is committed, an orphan that ``latest`` does not name."""
    def fail(ckpt_dir, name):
        raise OSError(errno.EIO, "injected: the write of latest fails", ckpt_dir)
    write_latest, checkpoint_dir.write_latest = checkpoint_dir.write_latest, fail
    try:
        with pytest.raises(CheckpointSaveError):
            save_checkpoint(ckpt, model, opt, step)
    finally:
        checkpoint_dir.write_latest = write_latest


def pause_after_commit(line: dict) -> float:
    """Rank 0 waits a little after each commit rename, before ``latest``: a rank that took
    the renamed folder for the commit would return, and be marked, in that window; and
    after the rename of ``latest``, before its fsync of the folder: ranks above 0 return
    only after an fsync of their own, which this makes come first."""
    if line["op"] != "rename" or os.path.dirname(line["dst"]) != CKPT:
        return 0.0
    name = os.path.basename(line["dst"])
    committing = not name.endswith((".deleting", ".partial")) and ".superseded-" not in name
    return COMMIT_PAUSE_S if committing and dist.is_initialized() else 0.0


def _ranks(rank, world, mesh, tmp, mode):
    run_saves(tmp, rank, world, mesh, mode)


def traced_run(tmp: str, world: int, mode: str) -> list[dict]:
    os.makedirs(os.path.join(tmp, "disk"))
    if world == 1:
        run_saves(tmp, 0, 1, None, mode)
    else:
        spawn(world, _ranks, tmp, mode)
    lines = read_log(os.path.join(tmp, f"trace-{mode}.log"))
    assert sum(line["op"] == "mark" for line in lines) == SAVES * world
    return lines


def disk_names(root: str) -> set[str]:
    out = set()
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            out.add(os.path.relpath(os.path.join(dirpath, name), root))
    return out


def check_trace(tmp: str, lines: list[dict], ranks: int, mode: str) -> None:
    model = replay(lines, CKPT)
    # the record is whole: the model's files are the disk's
    assert live_names(model) == disk_names(os.path.join(tmp, "disk"))
    assert len(model.committed) == SAVES * ranks
    assert any(line["op"] == "rename" and line["dst"].endswith(".deleting") for line in lines)
    assert model.violations == [], "\n".join(model.violations)
    # each fsync site of the save path left out in turn (all its calls): a violation, but
    # for the fsyncs of files removed before the commit (listed, and checked idle)
    idle = idle_syncs(lines, CKPT)
    unexplained = [s for s in idle if not any(re.search(p, s) for p in NOT_NEEDED)]
    assert not unexplained, ("fsyncs no power cut needs (or that the checks miss):\n"
                             + "\n".join(unexplained))
    sites = sync_sites(lines)
    for pattern, (why, made) in NOT_NEEDED.items():
        if made(ranks, mode):
            matching = [s for s in sites if re.search(pattern, s)]
            assert matching, f"no fsync of {pattern} ({why}) was recorded: a stale list?"
            assert set(matching) <= set(idle), f"{pattern}: {why}; yet a power cut needs it"


@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_power_cut_after_any_call_of_single_process_saves(tmp_path, mode):
    check_trace(str(tmp_path), traced_run(str(tmp_path), 1, mode), 1, mode)


def test_power_cut_after_any_call_of_a_save_that_sets_an_orphan_aside(tmp_path):
    lines = traced_run(str(tmp_path), 1, "orphan")
    assert any(".superseded-" in line.get("dst", "") for line in lines)
    check_trace(str(tmp_path), lines, 1, "orphan")


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_power_cut_after_any_call_of_two_rank_saves(tmp_path, mode):
    check_trace(str(tmp_path), traced_run(str(tmp_path), 2, mode), 2, mode)
