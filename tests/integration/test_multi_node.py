"""Two "nodes" on this machine: two torchrun launches of two processes each, joined by one
c10d rendezvous, as on a real cluster (docs/optimizer.md, "Several nodes").

HSDP replicates across the two nodes and shards within each; each node keeps its
optimizer state in a directory of its own (its local NVMe), checkpoints go to one directory
both see (the shared file system). A run saves at step 2, is SIGKILLed after step 3, and the
same launch resumes it from the checkpoint: every rank's loss and every parameter equal an
uninterrupted run's, bit for bit. With a checkpoint directory per node (no shared file
system) the save fails on every rank with an error naming the directory, and nothing is
committed on either node.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from helpers.paths import ROOT, script

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SCRIPT = script("multinode_train.py")
TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (torchrun starts its workers in sessions of their
    own: killing the agent leaves them running)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid:
                out.append(int(entry))
    return out


def stop(procs) -> None:
    """SIGKILL every launch still running and its workers."""
    for p in procs:
        if p.poll() is None:
            for pid in children(p.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.kill()
        p.wait()


@pytest.fixture
def launched():
    """Every launch a test starts, stopped at its end whatever happened."""
    procs: list = []
    yield procs
    stop(procs)


def launch(tmp, job: str, nodes: dict[str, dict], launched: list, **flags) -> dict[str, subprocess.Popen]:
    """One torchrun per node (``{node: {"store": dir, "ckpt": dir}}``), joined by one c10d
    rendezvous on a fresh port; their output goes to ``<tmp>/<job>-<node>.log``."""
    port = free_port()
    procs = {}
    for node, dirs in nodes.items():
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={job}",
               SCRIPT, "--store", dirs["store"], "--ckpt", dirs["ckpt"],
               "--out", os.path.join(tmp, job)]
        for k, v in flags.items():
            cmd += [f"--{k.replace('_', '-')}", str(v)]
        log = open(os.path.join(tmp, f"{job}-{node}.log"), "w")
        procs[node] = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                       env={**os.environ, "PYTHONPATH": ROOT,
                                            "OMP_NUM_THREADS": "1"})
        launched.append(procs[node])
    return procs


def wait(tmp, job: str, procs: dict) -> dict[str, int]:
    """Every launch's exit status."""
    out = {}
    for node, p in procs.items():
        try:
            out[node] = p.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            stop(procs.values())
            pytest.fail(f"{job}: node {node} did not finish in {TIMEOUT_S} s:\n" + logs(tmp, job))
    return out


def logs(tmp, job: str) -> str:
    text = ""
    for name in sorted(os.listdir(tmp)):
        if name.startswith(f"{job}-") and name.endswith(".log"):
            with open(os.path.join(tmp, name)) as f:
                text += f"--- {name}\n{f.read()[-3000:]}\n"
    return text


def losses(tmp, job: str) -> dict[int, dict[int, str]]:
    """{rank: {step: loss as float.hex}}."""
    out = {}
    for r in range(4):
        with open(os.path.join(tmp, job, f"loss-rank{r}.jsonl")) as f:
            out[r] = {d["step"]: d["loss"] for d in map(json.loads, f)}
    return out


def nodes(tmp, ckpt_a: str, ckpt_b: str, store_tag: str) -> dict:
    return {"A": {"store": os.path.join(tmp, "nodeA", store_tag), "ckpt": ckpt_a},
            "B": {"store": os.path.join(tmp, "nodeB", store_tag), "ckpt": ckpt_b}}


def test_two_nodes_train_hsdp_save_are_killed_and_resume_bit_for_bit(tmp_path, launched):
    tmp = str(tmp_path)
    shared = os.path.join(tmp, "shared", "ckpt")

    whole = launch(tmp, "whole", nodes(tmp, os.path.join(tmp, "shared", "ckpt_whole"),
                                       os.path.join(tmp, "shared", "ckpt_whole"), "whole"), launched)
    assert set(wait(tmp, "whole", whole).values()) == {0}, logs(tmp, "whole")

    killed = launch(tmp, "killed", nodes(tmp, shared, shared, "killed"), launched, hang_after=2)
    ready = [os.path.join(tmp, "killed", f"ready-rank{r}") for r in range(4)]
    deadline = time.monotonic() + TIMEOUT_S
    while not all(os.path.exists(p) for p in ready):
        assert all(p.poll() is None for p in killed.values()), logs(tmp, "killed")
        assert time.monotonic() < deadline, logs(tmp, "killed")
        time.sleep(0.2)
    time.sleep(0.1)  # the pid is written before the file is closed: read it whole
    for path in ready:  # SIGKILL every training process mid-run, then the agents
        with open(path) as f:
            os.kill(int(f.read()), signal.SIGKILL)
    for p in killed.values():
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
    with open(os.path.join(shared, "latest")) as f:
        assert f.read().strip() == "step-00000002"

    resumed = launch(tmp, "resumed", nodes(tmp, shared, shared, "resumed"), launched)
    assert set(wait(tmp, "resumed", resumed).values()) == {0}, logs(tmp, "resumed")

    want, before, after = losses(tmp, "whole"), losses(tmp, "killed"), losses(tmp, "resumed")
    for r in range(4):
        assert sorted(want[r]) == [0, 1, 2, 3]
        assert {s: before[r][s] for s in (0, 1, 2)} == {s: want[r][s] for s in (0, 1, 2)}, r
        assert sorted(after[r]) == [2, 3]               # resumed from step 2
        assert after[r] == {s: want[r][s] for s in (2, 3)}, r
    a = torch.load(os.path.join(tmp, "whole", "final.pt"))
    b = torch.load(os.path.join(tmp, "resumed", "final.pt"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert os.path.exists(os.path.join(tmp, "nodeA", "resumed")) \
        and os.path.exists(os.path.join(tmp, "nodeB", "resumed"))  # each node's own store


def test_two_nodes_without_a_shared_checkpoint_directory_fail_clearly_at_save(tmp_path, launched):
    tmp = str(tmp_path)
    local_a, local_b = os.path.join(tmp, "nodeA", "ckpt"), os.path.join(tmp, "nodeB", "ckpt")
    procs = launch(tmp, "local", nodes(tmp, local_a, local_b, "store"), launched, steps=2)
    codes = wait(tmp, "local", procs)
    assert all(c != 0 for c in codes.values()), logs(tmp, "local")
    messages = []
    for r in range(4):
        with open(os.path.join(tmp, "local", f"error-rank{r}.txt")) as f:
            messages.append(f.read())
    for m in messages:  # every rank says why, naming the directory its node was given
        assert "must be on a file system shared by all nodes" in m, m
        assert "rank 2 on" in m and "rank 3 on" in m and "rank 1 on" not in m, m
    assert any(local_a in m for m in messages) and any(local_b in m for m in messages)
    for d in (local_a, local_b):  # nothing committed, nothing torn left behind
        # (.writer-lock, the one-writer lock file, stays by design: docs/checkpoint.md)
        assert not os.path.exists(d) or not [n for n in os.listdir(d)
                                             if n not in ("latest", ".writer-lock")] \
            and not os.path.exists(os.path.join(d, "latest")), os.listdir(d)
