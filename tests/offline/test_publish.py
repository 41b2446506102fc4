"""consolidate's publish: a run that fails or is killed at any file system call leaves the
output folder with one complete export, the earlier or the new one, as a transformers
reader loads it; the next run cleans up after it; one run at a time per output folder."""

import os
import signal
import subprocess
import sys
import time

import pytest

from offload_engine.cli.main import main
from offload_engine.io import faults
from offload_engine.offline.out_lock import OutputLock, OutputLockedError

from helpers.paths import child_env, script
from helpers.publish_runs import StopAt, export, ours, read_export, same, tensors, write_source

OLD, NEW = tensors(0.0), tensors(100.0, count=5)  # new: other values and one tensor fewer

# (earlier export's tensors per shard, new export's); None is one file. 3 -> 3: the new
# shard names are the earlier export's own.
SWAPS = [(None, None), (2, 2), (2, 3), (None, 2), (2, None), (3, 3)]


def _expected_names(per_shard, count=5):
    if per_shard is None:
        return ["model.safetensors"]
    n = -(-count // per_shard)
    return sorted([f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
                  + ["model.safetensors.index.json"])


@pytest.fixture
def sources(tmp_path):
    return (write_source(str(tmp_path / "old.safetensors"), OLD),
            write_source(str(tmp_path / "new.safetensors"), NEW))


def _wait_until_ready(child, ready: str) -> None:
    """Until ``child`` has created ``ready`` (it then holds OUT for 6 s), at most 30 s."""
    deadline = time.monotonic() + 30
    while not os.path.exists(ready) and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.path.exists(ready), child.communicate()


def _calls(src, out, per_shard):
    """How many file system calls under ``out`` a run makes (on a copy of ``out``)."""
    plan = StopAt(out)
    faults.arm(plan)
    try:
        export(src, out, per_shard)
    finally:
        faults.disarm()
    return plan.count


@pytest.mark.parametrize("old_shards,new_shards", SWAPS)
def test_a_failure_or_crash_at_any_call_leaves_one_whole_export(tmp_path, sources, old_shards,
                                                               new_shards):
    old_src, new_src = sources
    probe = str(tmp_path / "probe")
    export(old_src, probe, old_shards)
    total = _calls(new_src, probe, new_shards)
    assert total > 5
    for nth in range(1, total + 1):
        out, snap = str(tmp_path / f"out{nth}"), str(tmp_path / f"crash{nth}")
        export(old_src, out, old_shards)
        open(os.path.join(out, "config.json"), "w").write("{}")
        plan = StopAt(out, nth, snapshot=snap)
        faults.arm(plan)
        try:
            export(new_src, out, new_shards)
            failed = False
        except OSError:
            failed = True
        finally:
            faults.disarm()
        assert plan.stopped_at is not None
        where = f"call {nth} of {total}: {plan.stopped_at}"
        # killed just before that call: a reader finds the earlier export or the new one
        crashed = read_export(snap)
        assert same(crashed, OLD) or same(crashed, NEW), where
        # failed at that call: the same, and the new one when the run reported success
        after = read_export(out)
        assert same(after, NEW) if not failed else (same(after, OLD) or same(after, NEW)), where
        # the next run, into what the crash left, publishes cleanly and removes the rest
        os.makedirs(os.path.join(snap, ".consolidate-tmp-1"))
        export(new_src, snap, new_shards)
        assert same(read_export(snap), NEW), where
        assert ours(snap) == _expected_names(new_shards), where


@pytest.mark.parametrize("old_shards,new_shards", SWAPS)
def test_a_rerun_replaces_the_export_and_keeps_other_files(tmp_path, sources, old_shards,
                                                          new_shards):
    old_src, new_src = sources
    out = str(tmp_path / "out")
    export(old_src, out, old_shards)
    open(os.path.join(out, "config.json"), "w").write("{}")
    names = export(new_src, out, new_shards)
    assert sorted(names) == _expected_names(new_shards)
    assert same(read_export(out), NEW)
    assert ours(out) == _expected_names(new_shards)
    assert open(os.path.join(out, "config.json")).read() == "{}"


def test_shards_stay_tagged_where_hard_links_are_refused(tmp_path, sources, monkeypatch):
    old_src, new_src = sources
    out = str(tmp_path / "out")
    export(old_src, out, 3)

    def no_links(src, dst):
        raise OSError(1, "Operation not permitted", dst)

    monkeypatch.setattr(os, "link", no_links)
    names = export(new_src, out, 3)
    assert same(read_export(out), NEW)
    assert names[-1] == "model.safetensors.index.json"
    assert all(".safetensors" in n and n.count(".") == 2 for n in names[:-1]), names  # tagged
    monkeypatch.undo()
    export(new_src, out, 3)  # the next run goes back to the plain names
    assert ours(out) == _expected_names(3)


def test_a_second_run_into_a_held_folder_is_refused(tmp_path, sources):
    _, new_src = sources
    out = tmp_path / "out"
    out.mkdir()
    with OutputLock(str(out)):
        with pytest.raises(OutputLockedError, match=f"process {os.getpid()} on "):
            export(new_src, str(out), 2)
    assert os.listdir(out) == []
    export(new_src, str(out), 2)  # released: the next run goes ahead


@pytest.mark.multiprocess
def test_two_concurrent_consolidations_one_refused_one_complete(tmp_path, sources, capsys):
    old_src, new_src = sources
    out = str(tmp_path / "out")
    export(old_src, out, 3)
    ready = str(tmp_path / "ready")
    first = subprocess.Popen([sys.executable, script("publish_child.py"), new_src, out, "2",
                              "hold", "rename", ready], env=child_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        _wait_until_ready(first, ready)
        assert main(["consolidate", old_src, out]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"process {first.pid} on " in err[0], err
        assert "another consolidation" in err[0]
    finally:
        outs, errs = first.communicate(timeout=120)
    assert first.returncode == 0, errs
    assert same(read_export(out), NEW)
    assert ours(out) == _expected_names(2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("old_shards,new_shards", [(3, 3), (None, 2)])
def test_sigkill_at_any_call_leaves_one_whole_export(tmp_path, sources, old_shards, new_shards):
    old_src, new_src = sources
    arg = lambda n: "one" if n is None else str(n)  # noqa: E731
    probe = str(tmp_path / "probe")
    export(old_src, probe, old_shards)
    counted = subprocess.run([sys.executable, script("publish_child.py"), new_src, probe,
                              arg(new_shards), "count"], env=child_env(), capture_output=True,
                             text=True, timeout=120)
    assert counted.returncode == 0, counted.stderr
    total = int(counted.stdout.split()[-1])
    for nth in range(1, total + 1):
        out = str(tmp_path / f"out{nth}")
        export(old_src, out, old_shards)
        run = subprocess.run([sys.executable, script("publish_child.py"), new_src, out,
                              arg(new_shards), "kill", str(nth)], env=child_env(),
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == -9, (nth, run.stderr)
        found = read_export(out)
        assert same(found, OLD) or same(found, NEW), f"killed at call {nth} of {total}"
        export(new_src, out, new_shards)
        assert ours(out) == _expected_names(new_shards), nth


@pytest.mark.multiprocess
@pytest.mark.parametrize("at", ["write", "rename"])
def test_sigterm_cleans_up_and_exits_143(tmp_path, sources, at):
    """SIGTERM while the shards are written, or while they are published: exit 143, no
    staging folder left, OUT holding one whole export."""
    old_src, new_src = sources
    out = str(tmp_path / "out")
    export(old_src, out, 3)
    ready = str(tmp_path / "ready")
    child = subprocess.Popen([sys.executable, script("publish_child.py"), new_src, out, "2",
                              "cli", at, ready], env=child_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        _wait_until_ready(child, ready)
        child.send_signal(signal.SIGTERM)
    finally:
        _, err = child.communicate(timeout=120)
    assert child.returncode == 143, err
    assert "terminated (SIGTERM)" in err and "Traceback" not in err, err
    assert not [n for n in os.listdir(out) if n.startswith(".consolidate-tmp-")]
    found = read_export(out)
    assert same(found, OLD) or same(found, NEW)
    assert ours(out) in (_expected_names(3, count=6), _expected_names(2))


def test_an_unreadable_index_counts_every_output_name_as_in_use(tmp_path, sources):
    """An index that is not JSON: nothing of the folder is known to be garbage, so the new
    shards go in under tagged names first; the run still ends with the plain names."""
    old_src, new_src = sources
    out = str(tmp_path / "out")
    export(old_src, out, 2)
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        f.write("{not json")
    export(new_src, out, 2)
    assert same(read_export(out), NEW)
    assert ours(out) == _expected_names(2)
