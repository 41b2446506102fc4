import atexit
import os
import shutil
import sys
import tempfile

import pytest

# markers checked while each test runs: a test that starts a process must be marked
# multiprocess, one that moves more than 1 GiB must be marked slow (tests/helpers/marker_guard.py)
pytest_plugins = ["helpers.marker_guard"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# No test probes the disk by accident, and no developer's cached device profile changes what
# a test does: stores use the built-in I/O defaults unless a test sets a mode or a profile
# (tests/io/test_device_profile.py). Child processes inherit both.
os.environ["OFFLOAD_ENGINE_IO_PROBE"] = "0"
_PROFILES = tempfile.mkdtemp(prefix="oe-test-profiles-")
os.environ["OFFLOAD_ENGINE_PROFILE_DIR"] = _PROFILES
atexit.register(shutil.rmtree, _PROFILES, True)


@pytest.fixture
def disk_dir(tmp_path):
    """A directory on a real disk file system (tmp_path may be tmpfs on some machines)."""
    return tmp_path


def python_exe() -> str:
    return sys.executable
