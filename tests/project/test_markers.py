"""The marker checks of tests/helpers/marker_guard.py fire: a test that starts a process without
``multiprocess``, or moves more than the limit without ``slow``, fails naming the marker; with
the marker it passes. An inner pytest run, in a child process, runs such tests."""

import os
import subprocess
import sys
import textwrap

import pytest

from helpers.marker_guard import GIB, process_violation, slow_violation
from helpers.paths import child_env

INNER = textwrap.dedent("""
    import multiprocessing, os, subprocess, sys
    import pytest

    def test_unmarked_subprocess():
        subprocess.run([sys.executable, "-c", "pass"], check=True)

    def test_unmarked_multiprocessing():
        p = multiprocessing.get_context("spawn").Process(target=print)
        p.start()
        p.join()

    def test_unmarked_subprocess_caught():
        try:
            subprocess.run([sys.executable, "-c", "pass"])
        except BaseException:
            pass

    @pytest.mark.multiprocess
    def test_marked_subprocess():
        subprocess.run([sys.executable, "-c", "pass"], check=True)

    def write_twice_the_limit(path):
        with open(path, "wb") as f:
            f.write(os.urandom(2 << 20))

    def test_unmarked_bytes(tmp_path):
        write_twice_the_limit(tmp_path / "f")

    @pytest.mark.slow
    def test_marked_bytes(tmp_path):
        write_twice_the_limit(tmp_path / "f")

    def test_nothing():
        pass
""")

INI = """[pytest]
markers =
    slow: moves gigabytes
    multiprocess: starts processes
"""


@pytest.mark.multiprocess
def test_unmarked_tests_fail_naming_the_marker_and_marked_ones_pass(tmp_path):
    (tmp_path / "test_inner.py").write_text(INNER)
    (tmp_path / "pytest.ini").write_text(INI)
    env = child_env(dict(os.environ, OE_TEST_SLOW_BYTES=str(1 << 20)))  # 1 MiB; the test writes 2
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "helpers.marker_guard", "-p",
                           "no:cacheprovider", "-rA", "-q", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout
    outcome = {}
    for line in out.splitlines():
        for word in ("PASSED", "FAILED", "ERROR"):
            if line.startswith(word + " "):
                outcome[line.split()[1].split("::")[1]] = word
    assert outcome == {"test_unmarked_subprocess": "FAILED", "test_unmarked_multiprocessing": "FAILED",
                       "test_unmarked_subprocess_caught": "FAILED", "test_unmarked_bytes": "FAILED",
                       "test_marked_subprocess": "PASSED", "test_marked_bytes": "PASSED",
                       "test_nothing": "PASSED"}, out + done.stderr
    for name in ("test_unmarked_subprocess", "test_unmarked_multiprocessing", "test_unmarked_subprocess_caught"):
        assert f"test_inner.py::{name} started a process" in out and "@pytest.mark.multiprocess" in out
    assert "test_inner.py::test_unmarked_bytes moved" in out and "@pytest.mark.slow" in out


def test_slow_limit_is_read_plus_written():
    start = (10, 20)
    assert slow_violation("t", start, (10 + GIB // 2, 20 + GIB // 2), GIB) is None
    message = slow_violation("t", start, (10 + GIB // 2, 20 + GIB // 2 + 1), GIB)
    assert message.startswith("t moved 1.00 GiB") and "@pytest.mark.slow" in message


def test_process_message_names_the_marker():
    assert "@pytest.mark.multiprocess" in process_violation("t", "subprocess ['x']")
