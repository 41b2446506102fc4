import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def disk_dir(tmp_path):
    """A directory on a real disk file system (tmp_path may be tmpfs on some machines)."""
    return tmp_path


def python_exe() -> str:
    return sys.executable
