"""One directory listed twice in nvme_paths (issue 30, item 9c): refused before any lock is
taken, with a message naming both entries. Before the fix the second lock of the directory
was refused by the first and the error named this very process as the holder."""

import os

import pytest

from offload_engine.errors import InputError
from offload_engine.store import TieredStore


def spellings(tmp_path):
    """(first entry, second entry) pairs that are one directory, however written."""
    d = tmp_path / "nvme"
    d.mkdir()
    link = tmp_path / "link"
    os.symlink(d, link)
    return {
        "same string": (str(d), str(d)),
        "trailing dot": (str(d), str(d / ".")),
        "dot-dot": (str(d), str(tmp_path / "other" / ".." / "nvme")),
        "symlink": (str(d), str(link)),
        "relative": (str(d), os.path.relpath(d)),
    }


@pytest.mark.parametrize("case", ["same string", "trailing dot", "dot-dot", "symlink", "relative"])
def test_one_directory_listed_twice_is_refused_naming_both_entries(tmp_path, case):
    (tmp_path / "other").mkdir()
    first, second = spellings(tmp_path)[case]
    with pytest.raises(InputError) as info:
        TieredStore({"nvme_paths": [first, str(tmp_path / "third"), second],
                     "cpu_budget": "64KiB", "bucket_bytes": "16KiB"})
    message = str(info.value)
    assert repr(first) in message and repr(second) in message, message
    assert "entry 0" in message and "entry 2" in message
    assert "twice" in message
    assert "already open for writing" not in message and str(os.getpid()) not in message
    # nothing stays locked: the directory opens as a store at once
    with TieredStore({"nvme_paths": [first], "cpu_budget": "64KiB", "bucket_bytes": "16KiB"}):
        pass


def test_distinct_directories_still_open(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    with TieredStore({"nvme_paths": [str(a), str(b)], "cpu_budget": "64KiB",
                      "bucket_bytes": "16KiB"}) as store:
        assert store.root == str(a)
