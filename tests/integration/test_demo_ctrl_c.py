"""Ctrl-C in the demo, sent as a terminal sends it: SIGINT to the whole process group."""

import os
import select
import signal
import subprocess
import sys
import time

import pytest


def _wait_for(proc, text: str, timeout_s: float) -> str:
    """stdout of ``proc`` up to the first line holding ``text``."""
    seen, deadline = "", time.monotonic() + timeout_s
    while text not in seen:
        left = deadline - time.monotonic()
        assert left > 0 and proc.poll() is None, f"no {text!r} in time; output so far:\n{seen}"
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            seen += os.read(proc.stdout.fileno(), 65536).decode()
    return seen


def _group_alive(pgid: int, timeout_s: float) -> bool:
    """Whether a process of group ``pgid`` is still there after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.2)
    return True


@pytest.mark.multiprocess
def test_ctrl_c_ends_the_demo_with_one_line_and_130_children_stopped_folder_removed(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "offload_engine.cli.main", "demo", "--model", "tiny",
         "--steps", "400", "--world-size", "2", "--no-reference"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _wait_for(proc, "   2  ", timeout_s=240)   # training is under way: step 2 reported
        os.killpg(proc.pid, signal.SIGINT)          # what the terminal does on Ctrl-C
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = err.decode()
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["offload-engine demo: interrupted (Ctrl-C)"], err
    assert not _group_alive(proc.pid, timeout_s=20), subprocess.run(
        ["ps", "-o", "pid,stat,args", "-g", str(proc.pid)], capture_output=True, text=True).stdout
    assert not [p for p in os.listdir(tmp_path) if p.startswith("offload-engine-demo-")]
