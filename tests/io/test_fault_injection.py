"""Fault injection: a full disk (ENOSPC) or a failing device (EIO) at every file system call
of the store and of checkpoint saving.

Every such call goes through offload_engine/io/syscalls.py (the first test checks that no
direct call is left), which a test arms with a FaultPlan (io/faults.py). Each scenario
(tests/helpers/fault_scenarios.py) is first run counting its calls by kind and site (the engine
function making the call); then once per site and errno with that site's first call
failing (and, marked slow, its last). After each run, with the fault cleared, we assert:

- nothing hangs: the scenario, close() included, ends within a deadline;
- the error reached the caller as an OSError naming the file and the errno;
- no byte the store held is lost: after a flush, the live store and the store reopened
  from disk hold exactly what was written;
- generation 1, saved before the fault, loads bit-exact (every parameter and state
  tensor), and so does generation 2 when it was committed; ``latest`` names one of them.

The counts of faults injected are printed (run with -s to see them) and asserted to cover
every site. The store sweeps run in the quick suite; the optimizer sweeps (a model, steps,
saves and loads per site) are marked slow. tests/io/test_full_disk.py holds the quick
regression tests of the defects these sweeps found.
"""

from __future__ import annotations

import ast
import errno
import os
import pathlib

import pytest

from helpers import fault_scenarios as fs
from offload_engine.io import faults
from offload_engine.io.faults import FaultPlan
from helpers.paths import ROOT

PACKAGE = pathlib.Path(ROOT) / "offload_engine"

# -- every call goes through io/syscalls.py ---------------------------------------------------------
_OS_CALLS = {"open", "pwrite", "pwritev", "write", "preadv", "pread", "read", "fsync",
             "fdatasync", "posix_fallocate", "ftruncate", "truncate", "rename", "renames",
             "replace", "makedirs", "mkdir", "remove", "removedirs", "unlink", "rmdir",
             "symlink", "link"}
_SHUTIL_CALLS = {"rmtree", "copy", "copy2", "copyfile", "copytree", "move"}
_SCOPE = ("io", "layout", "store", "checkpoint")
_EXEMPT = {
    "io/syscalls.py": "the calls themselves",
    "io/faults.py": "the fault plan",
}
# builtin open() reading a file that is not the store's or a checkpoint's: the user's config
_OPEN_ALLOWED = {"store/config.py"}


def _direct_calls(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            if (f.value.id == "os" and f.attr in _OS_CALLS) or \
                    (f.value.id == "shutil" and f.attr in _SHUTIL_CALLS):
                found.append(f"{f.value.id}.{f.attr} (line {node.lineno})")
        elif isinstance(f, ast.Name) and f.id == "open":
            found.append(f"open (line {node.lineno})")
    return found


def test_every_file_call_of_the_store_and_of_saving_goes_through_syscalls():
    """So that the fault plan reaches every call: a new direct call fails this test."""
    offenders = {}
    checked = 0
    for pkg in _SCOPE:
        for path in sorted((PACKAGE / pkg).glob("*.py")):
            rel = f"{pkg}/{path.name}"
            if rel in _EXEMPT:
                continue
            calls = _direct_calls(path)
            if rel in _OPEN_ALLOWED:
                calls = [c for c in calls if not c.startswith("open ")]
            checked += 1
            if calls:
                offenders[rel] = calls
    assert checked > 30
    assert not offenders, f"direct file system calls (use offload_engine.io.syscalls): {offenders}"


# -- the fault plan itself ------------------------------------------------------------------------------
def test_a_plan_fails_the_nth_matching_call_only_under_its_directory(tmp_path):
    from offload_engine.io import AsyncFileIO, FileIOError
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    elsewhere.mkdir()
    plan = FaultPlan(kind="write", nth=2, errno=errno.EIO, under=str(tmp_path))
    with AsyncFileIO(threads=1, queue_depth=1) as io, faults.injected(plan):
        io.write(str(elsewhere / "x"), 0, b"a" * 10).result()   # not under: not counted
        io.write(str(tmp_path / "a"), 0, b"a" * 10).result()    # the first: runs
        with pytest.raises(FileIOError) as info:
            io.write(str(tmp_path / "b"), 0, b"b" * 10).result()
        io.write(str(tmp_path / "c"), 0, b"c" * 10).result()    # times=1: the third runs
    assert info.value.errno == errno.EIO and str(tmp_path / "b") in str(info.value)
    assert [(k, p) for k, _, p in plan.injected] == [("write", str(tmp_path / "b"))]
    assert plan.calls[("write", "io.file_io._loop")] == 3
    assert faults._plan is None


# -- the sweeps -----------------------------------------------------------------------------------------
def _sites(scenario_cls, tmp_path) -> dict:
    """(kind, site) -> calls, from one run of the scenario with a plan that only counts."""
    root = str(tmp_path / "count")
    os.makedirs(root)
    sc = scenario_cls(root)
    plan = FaultPlan(nth=0, under=root, label=fs.path_label(root))
    out = fs.run_ops(sc.ops(), plan)
    assert not out.hung and out.failure is None and not out.errors, out
    sc.check_recovered(out)
    return dict(plan.calls)


def _sweep(scenario_cls, tmp_path, last: bool, persistent: bool = False,
           errnos: tuple = fs.ERRNOS) -> dict:
    """Run the scenario once per site and errno with a fault at the site's first call (or
    last); returns counts for the report. Any broken promise fails the test at once."""
    sites = _sites(scenario_cls, tmp_path)
    report = {"sites": len(sites), "injected": 0, "surfaced": 0, "absorbed": 0, "by_kind": {},
              "absorbed_at": set()}
    for (kind, site), calls in sorted(sites.items()):
        nth = calls if last else 1
        if last and calls == 1:
            continue  # the first call was that one
        for code in errnos:
            root = str(tmp_path / f"{kind}-{site}-{nth}-{code}")
            os.makedirs(root)
            where = f"{scenario_cls.__name__}: {errno.errorcode[code]} at call {nth} of {kind} in {site}"
            sc = scenario_cls(root)
            plan = FaultPlan(kind=kind, site=site, nth=nth, errno=code, under=root,
                             times=None if persistent else 1, label=fs.path_label(root))
            out = fs.run_ops(sc.ops(), plan)
            assert not out.hung, f"{where}: hung (stacks above)"
            assert out.failure is None, f"{where}: no recovery once the fault was cleared: " \
                                        f"{out.failure!r}"
            if not plan.injected:
                continue  # the call did not come this time (an order that varies)
            report["injected"] += 1
            report["by_kind"][kind] = report["by_kind"].get(kind, 0) + 1
            if out.errors:
                report["surfaced"] += 1
                op, err = out.errors[0]
                fs.check_error_names_the_file(err, root, code, f"{where} (in {op})")
            else:
                report["absorbed"] += 1  # retried or best effort: the checks still apply
                report["absorbed_at"].add(f"{kind} {site}")
            sc.check_recovered(out)
    print(f"\n{scenario_cls.__name__} ({'last' if last else 'first'} call"
          f"{', persistent' if persistent else ''}, "
          f"{'/'.join(errno.errorcode[c] for c in errnos)}): {report}")
    aimed = sum(1 for calls in sites.values() if not last or calls > 1) * len(errnos)
    assert report["injected"] >= 0.9 * aimed, report  # nearly every site saw its fault
    return report


def test_store_keeps_every_byte_with_a_fault_at_every_call_site(tmp_path):
    _sweep(fs.StoreScenario, tmp_path, last=False)


def test_store_keeps_every_byte_when_the_disk_stays_full_from_any_call_site(tmp_path):
    """The fault lasts (every later call of that site fails) until the scenario sees an
    error; then the disk has room again."""
    _sweep(fs.StoreScenario, tmp_path, last=False, persistent=True)


@pytest.mark.slow  # a tiny model, steps, saves and loads for every site: tens of seconds
def test_an_optimizer_opens_steps_and_closes_its_store_with_a_fault_at_every_call_site(tmp_path):
    _sweep(fs.OptimizerOpenScenario, tmp_path, last=False)


@pytest.mark.slow  # a tiny model, steps, saves and loads for every site: tens of seconds
def test_step_and_save_keep_every_byte_with_a_full_disk_at_every_call_site(tmp_path):
    _sweep(fs.OptimizerScenario, tmp_path, last=False, errnos=(errno.ENOSPC,))


@pytest.mark.slow
def test_step_and_save_keep_every_byte_with_an_io_error_at_every_call_site(tmp_path):
    _sweep(fs.OptimizerScenario, tmp_path, last=False, errnos=(errno.EIO,))


@pytest.mark.slow
def test_step_and_save_keep_every_byte_when_the_disk_stays_full_from_any_call_site(tmp_path):
    _sweep(fs.OptimizerScenario, tmp_path, last=False, persistent=True, errnos=(errno.ENOSPC,))


@pytest.mark.slow
def test_a_fault_at_the_last_call_of_every_site(tmp_path):
    _sweep(fs.StoreScenario, tmp_path / "store", last=True)
    _sweep(fs.OptimizerScenario, tmp_path / "optimizer", last=True)


# -- several ranks (real processes, gloo) ----------------------------------------------------------------
# (failing rank, FaultPlan arguments): a subset of the sites, on one rank of two
MULTI_RANK_CASES = [
    (1, dict(kind="write", site="io.file_io._loop@ck:chunk", errno=errno.ENOSPC)),
    (1, dict(kind="rename", site="layout.metadata.replacing@ck:.done.json", errno=errno.EIO)),
    (0, dict(kind="rename", site="checkpoint.checkpoint_dir.commit@ck:dir", errno=errno.ENOSPC)),
    (0, dict(kind="mkdir", site="checkpoint.checkpoint_dir.prepare_staging@ck:dir",
             errno=errno.EIO)),
    # rank 1's disk stays full: not even its failure report can be written in full
    (1, dict(kind="write", errno=errno.ENOSPC, times=None)),
    # rank 0 cannot write the marker that checks every rank sees the directory
    (0, dict(kind="rename", site="layout.metadata.replacing@ck:dir", errno=errno.EIO)),
]


def _save_with_a_fault_on_one_rank(rank, world, mesh, tmp):
    import torch.distributed as dist
    from offload_engine.checkpoint import load_checkpoint, save_checkpoint, save_checkpoint_async
    ck = os.path.join(tmp, "ck")
    model, opt = fs.make_optimizer(os.path.join(tmp, "state"), mesh=mesh)
    fs.set_grads(model, 0)
    opt.step()
    save_checkpoint(ck, model, opt, 1)
    gen1 = fs.capture(model, opt)
    for i, (bad, kw) in enumerate(MULTI_RANK_CASES):
        step = 2 + i
        where = f"case {i} (rank {bad}: {kw})"
        fs.set_grads(model, step)
        opt.step()
        plan = FaultPlan(under=ck, label=fs.path_label(tmp), **kw)
        err = None
        if rank == bad:
            faults.arm(plan)
        try:
            save_checkpoint_async(ck, model, opt, step, commit_timeout_s=60).wait(120)
        except Exception as e:
            err = e
        finally:
            faults.disarm()
        seen = [None] * world
        dist.all_gather_object(seen, (len(plan.injected), None if err is None else str(err)))
        assert sum(n for n, _ in seen) >= 1, f"{where}: no fault was injected"
        for r, (_, text) in enumerate(seen):  # every rank's save failed, naming the rank
            assert text is not None, f"{where}: rank {r}'s save did not fail"
            assert f"rank {bad}" in text, f"{where}: rank {r}'s error names no rank {bad}: {text}"
        if rank == bad:
            fs.check_error_names_the_file(err, ck, kw["errno"], where)
        assert not os.path.isdir(os.path.join(ck, f"step-{step:08d}")), where
        with open(os.path.join(ck, "latest")) as f:
            assert f.read().strip() == "step-00000001", where
        # generation 1 loads bit-exact on both ranks
        m2, o2 = fs.make_optimizer(os.path.join(tmp, f"load-{i}"), seed=77, mesh=mesh)
        assert load_checkpoint(ck, m2, o2, tag="step-00000001") == 1
        fs.assert_same(m2, o2, gen1, f"{where}: generation 1 on rank {rank}")
        o2.close()
        dist.barrier()
    # rank 0 cannot remove that marker once every rank has seen it: the others are already
    # writing, so the save goes on (raising on rank 0 alone left them waiting an hour)
    fs.set_grads(model, 50)
    opt.step()
    plan = FaultPlan(under=ck, label=fs.path_label(tmp), kind="remove",
                     site="checkpoint.shared_dir.remove_marker@ck:dir", errno=errno.EIO)
    if rank == 0:
        faults.arm(plan)
    try:
        save_checkpoint_async(ck, model, opt, 50, commit_timeout_s=60).wait(120)
    finally:
        faults.disarm()
    if rank == 0:
        assert len(plan.injected) == 1, plan.injected
    # no fault: the next save commits, and loads bit-exact
    want = fs.capture(model, opt)
    save_checkpoint(ck, model, opt, 99)
    m2, o2 = fs.make_optimizer(os.path.join(tmp, "load-99"), seed=77, mesh=mesh)
    assert load_checkpoint(ck, m2, o2) == 99
    fs.assert_same(m2, o2, want, f"generation 99 on rank {rank}")
    o2.close()
    opt.close()


@pytest.mark.multiprocess
def test_a_fault_on_one_rank_fails_every_ranks_save_naming_it(tmp_path):
    from helpers.zero_muon_harness import spawn
    spawn(2, _save_with_a_fault_on_one_rank, str(tmp_path))
    print(f"\nmulti-rank: {len(MULTI_RANK_CASES)} faults injected on one rank of two")
