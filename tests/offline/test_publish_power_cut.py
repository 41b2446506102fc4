"""A power cut at any step of consolidate's publish, with the pessimistic model of
helpers/publish_trace.py: the folder a restart finds holds the earlier export or the new
one, whole; after the run returned, the new one. Leaving out any of publish's directory
fsyncs breaks that in at least one of these swaps."""

import pytest

from helpers.publish_runs import export, same, tensors, write_source
from helpers.publish_trace import Trace, cut_states, load

OLD, NEW = tensors(0.0), tensors(100.0, count=5)
SWAPS = [(None, None), (2, 3), (None, 2), (2, None), (3, 3)]


def _traced(tmp_path, monkeypatch, old_shards, new_shards, name):
    old_src = write_source(str(tmp_path / "old.safetensors"), OLD)
    new_src = write_source(str(tmp_path / "new.safetensors"), NEW)
    out = str(tmp_path / f"out-{name}")
    export(old_src, out, old_shards)
    with monkeypatch.context() as patch:
        trace = Trace(out, str(tmp_path / f"inodes-{name}"), patch)
        export(new_src, out, new_shards)
    return trace


def _problems(trace, folder, skip_sync=None):
    problems = []
    for where, entries in cut_states(trace, skip_sync):
        try:
            found = load(trace, entries, folder)
        except (FileNotFoundError, AssertionError) as e:  # a shard missing, or another's
            found = f"broken: {e}"
        final = where == "after the run returned"
        if not (same(found, NEW) or (not final and same(found, OLD))):
            problems.append(f"{where}: {sorted(entries)}")
    return problems


@pytest.mark.parametrize("old_shards,new_shards", SWAPS)
def test_a_power_cut_at_any_step_leaves_one_whole_export(tmp_path, monkeypatch, old_shards,
                                                          new_shards):
    trace = _traced(tmp_path, monkeypatch, old_shards, new_shards, "run")
    assert trace.steps[-1][0] == "sync"
    assert _problems(trace, str(tmp_path / "restart")) == []


def test_every_directory_fsync_is_needed(tmp_path, monkeypatch):
    """Each fsync of OUT that publish makes, left out, lets a power cut break some swap."""
    traces = [_traced(tmp_path, monkeypatch, o, n, f"{o}-{n}") for o, n in SWAPS]
    needed = set()
    for k, trace in enumerate(traces):
        syncs = sum(step[0] == "sync" for step in trace.steps)
        for skip in range(syncs):
            if _problems(trace, str(tmp_path / f"restart{k}-{skip}"), skip_sync=skip):
                needed.add((k, skip))
    for k, trace in enumerate(traces):
        syncs = sum(step[0] == "sync" for step in trace.steps)
        # the fsync after removing the earlier export's files only makes the clean-up
        # durable: a cut before it still finds the new export
        cleanup = 1 if trace.steps[-2][0] == "unlink" else 0
        for skip in range(syncs - cleanup):
            assert (k, skip) in needed, (SWAPS[k], skip, trace.steps)
