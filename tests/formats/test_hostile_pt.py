"""Hostile torch.save files: each is refused (or read harmlessly) with a one-line
CheckpointFileError, and reading it stays under 512 MiB of RSS.

Each payload (tests/helpers/hostile_pt.py) is read in a child process limited to 2 GiB of address
space (RLIMIT_AS), so an unfixed reader fails with MemoryError instead of taking the test
machine down; the child reports what load_pt raised and its peak RSS.
"""

import os
import struct

import pytest

from helpers import hostile_pt as H
from offload_engine.formats import pt_limits
from offload_engine.formats.safe_unpickler import CheckpointFileError, load_pt
from helpers.paths import DEEPSPEED_FIXTURES

LIMIT = 2 << 30
MAX_RSS = 512 << 20


def _payload(name):
    return {
        # the two
        "deflated_data_pkl": lambda p: H.write_deflated_bomb(p, 100 << 20),
        "bytearray_int": H.PAYLOADS["bytearray_int"],
        # length and index fields the C unpickler allocated from before reading
        "memo_long_binput": H.PAYLOADS["memo_long_binput"],
        "memo_text_put": H.PAYLOADS["memo_text_put"],
        "binbytes8_length": H.PAYLOADS["binbytes8_length"],
        "bytearray8_length": H.PAYLOADS["bytearray8_length"],
        # cheap opcodes, each building a big object
        "empty_sets": H.PAYLOADS["empty_sets"],
        "inert_classes": lambda p: H._inert_classes(p, pt_limits.MAX_INERT_CLASSES + 1),
        "set_of_memo_list": H.PAYLOADS["set_of_memo_list"],
        # a zip directory just over the cap
        "many_zip_entries": lambda p: H.write_many_entries(p, pt_limits.MAX_RECORDS + 1),
        # forged tensor metadata
        "tensor_forged_sizes": H.PAYLOADS["tensor_forged_sizes"],
        "tensor_build_after_check": H.PAYLOADS["tensor_build_after_check"],
        "dtype_build": H.PAYLOADS["dtype_build"],
        "shape_product_cpu": H.PAYLOADS["shape_product_cpu"],
        "deep_tuple": H.PAYLOADS["deep_tuple"],
    }[name]


# payloads that must be refused; the others hold a harmless pickle and may load
REFUSED = ["deflated_data_pkl", "bytearray_int", "empty_sets", "inert_classes", "set_of_memo_list",
           "many_zip_entries", "tensor_forged_sizes", "tensor_build_after_check", "dtype_build",
           "shape_product_cpu", "deep_tuple"]
HARMLESS = ["memo_long_binput", "memo_text_put", "binbytes8_length", "bytearray8_length"]


# the two that unpickle ~2 million opcodes before the budget stops them (30-60 s)
SLOW = {"empty_sets", "set_of_memo_list"}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in REFUSED + HARMLESS])
def test_hostile_file_is_bounded(tmp_path, name):
    path = str(tmp_path / f"{name}.pt")
    _payload(name)(path)
    r = H.measure(path, LIMIT, timeout=300)
    outcome = r["outcome"]
    assert "MemoryError" not in outcome and "died" not in outcome and "still running" not in outcome, outcome
    assert "itemsize is now" not in outcome, outcome  # a shared dtype changed by the file
    if name in REFUSED:
        assert outcome.startswith("CheckpointFileError: " + path), outcome
    else:
        assert outcome == "loaded" or outcome.startswith("CheckpointFileError: " + path), outcome
    assert r["peak_rss"] < MAX_RSS, r


def test_compressed_data_pkl_named_in_error(tmp_path):
    path = str(tmp_path / "bomb.pt")
    H.write_deflated_bomb(path, 1 << 20)
    with pytest.raises(CheckpointFileError, match=r"bomb\.pt: record archive/data\.pkl is compressed"):
        load_pt(path)


def test_storage_bigger_than_its_record(tmp_path):
    # a storage declared as 1000 floats whose record holds 4: refused when loaded, before
    # any reader trusts the declared size
    path = str(tmp_path / "short.pt")
    H.write_pt(path, H.pkl(H.tensor("0", (4,), (1,), numel=1000)), {"0": bytes(16)})
    with pytest.raises(CheckpointFileError, match=r"short\.pt: storage data/0 declares 1000 elements "
                                                  r"of float32 \(4000 bytes\) but its record has 16 bytes"):
        load_pt(path)


def test_bytearray_of_bytes_still_loads(tmp_path):
    # protocol 2 pickles a bytearray as bytearray(str, 'latin-1'): still read
    path = str(tmp_path / "ba.pt")
    H.write_pt(path, H.pkl(H.call(H.glob("builtins", "bytearray"), H.uni("ab\u00ff"), H.uni("latin-1"))))
    assert load_pt(path).obj == bytearray(b"ab\xff")


def test_data_pkl_over_cap_refused_before_reading(tmp_path, monkeypatch):
    path = str(tmp_path / "big.pt")
    H.write_pt(path, H.pkl(b"\x8e" + struct.pack("<Q", 5000) + bytes(5000)))
    monkeypatch.setattr(pt_limits, "MAX_PICKLE_BYTES", 4096)
    with pytest.raises(CheckpointFileError, match=r"big\.pt: record 'data\.pkl' has 5012 bytes; at most 4096"):
        load_pt(path)


def test_real_fixtures_fit_the_budget():
    # every real DeepSpeed file we have reads far inside the unpickling budget
    from offload_engine.formats.safe_unpickler import PtArchive, RestrictedUnpickler
    root = DEEPSPEED_FIXTURES
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".pt"):
                path = os.path.join(dirpath, f)
                data = PtArchive(path).read_record("data.pkl", pt_limits.MAX_PICKLE_BYTES)
                u = RestrictedUnpickler(data, path)
                u.load()
                assert u.charged < pt_limits.MAX_UNPICKLE_BYTES / 100


def test_zip_of_unknown_version_is_a_checkpoint_file_error(tmp_path):
    # found by tests/helpers/fuzz_readers.py: zipfile raises NotImplementedError for a central
    # directory entry that needs a zip version it does not know
    path = str(tmp_path / "v.pt")
    H.write_pt(path, H.pkl(b"N"))
    raw = bytearray(open(path, "rb").read())
    at = raw.find(b"PK\x01\x02")
    raw[at + 6:at + 8] = struct.pack("<H", 64)  # version needed to extract: 6.4
    open(path, "wb").write(bytes(raw))
    with pytest.raises(CheckpointFileError, match=r"v\.pt: not a readable torch checkpoint"):
        load_pt(path)
