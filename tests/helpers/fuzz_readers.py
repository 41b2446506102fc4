"""Fuzz targets for the readers of untrusted input: DeepSpeed rank files and our manifests.

Each target draws a mutation of a real input with hypothesis, runs the reader on it, and
accepts only the errors the project documents for bad input (``ALLOWED``, listed in
docs/untrusted-input.md); any other exception is a crash. The inputs:

- ``deepspeed``: a copy of a real DeepSpeed checkpoint (tests/fixtures/deepspeed/) with one
  rank file mutated: bytes anywhere in the zip, bytes of data.pkl (the zip rewritten around
  it, so the pickle parser sees them), plain values of data.pkl (tensor sizes, offsets,
  storage sizes, partition counts, param_shapes, names, flags) replaced by edge integers or
  values of another type (None, a list, a dict...), or zip header fields. The reader is ``DeepSpeedSource``: open, list, read the first elements of every
  state.
- ``manifest``: the zarr.json of a small checkpoint written with tests/helpers/synthetic.py, its
  JSON document mutated (values replaced, keys dropped, containers emptied, numbers made
  huge or negative). The readers are ``parse_manifest`` and ``OursSource``.

Run as a script, it runs ``N`` examples of a target in this process and prints the peak
RSS (tests/formats/test_fuzz_readers.py runs it in a child limited by RLIMIT_AS):

    PYTHONPATH=$PWD python tests/helpers/fuzz_readers.py deepspeed 2000
"""

from __future__ import annotations

import copy
import io
import json
import os
import pickletools
import resource
import shutil
import struct
import sys
import tempfile
import zipfile

from hypothesis import HealthCheck, given, settings, strategies as st

from offload_engine.formats.deepspeed import DeepSpeedSource
from offload_engine.formats.deepspeed.partitions import PartitionError
from offload_engine.formats.errors import FormatError
from offload_engine.formats.source import ReadRequest
from offload_engine.io.errors import FileIOError
from offload_engine.layout.checksums import ChecksumError
from offload_engine.layout.metadata import ForeignArrayError, MetadataError
from helpers.paths import DEEPSPEED_FIXTURES as FIXTURES


# The errors bad input may raise (docs/untrusted-input.md). FormatError covers
# CheckpointError, CheckpointFileError, UnsafePickleError and DeepSpeedLayoutError.
ALLOWED = (FormatError, PartitionError, ChecksumError, MetadataError, ForeignArrayError, FileIOError)

# Elements read from the start of every state of every tensor (a read past what the
# files hold must be refused, not allocated).
READ_ELEMENTS = 256

EDGE_INTS = [0, 1, -1, 2, 3, 7, 255, 256, 65535, 2**31 - 1, 2**31, 2**32, 2**62, 2**63 - 1,
             2**63, 2**64, 10**18, -2**63, 10**30]


# -- DeepSpeed ---------------------------------------------------------------------------------

def _encode_int(n: int) -> bytes:
    if 0 <= n < 256:
        return b"K" + bytes([n])
    if -2**31 <= n < 2**31:
        return b"J" + struct.pack("<i", n)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


_VALUE_OPS = {"BININT", "BININT1", "BININT2", "LONG1", "BINUNICODE", "SHORT_BINUNICODE",
              "NONE", "NEWTRUE", "NEWFALSE", "BINFLOAT", "EMPTY_TUPLE"}


def _value_positions(pkl: bytes) -> list[tuple[int, int]]:
    """(start, end) byte ranges of every opcode of a pickle that pushes a plain value (an
    int, a str, None, a bool, a float): tensor sizes, offsets, names, counts, flags."""
    ops = list(pickletools.genops(pkl))
    out = []
    for i, (op, _arg, pos) in enumerate(ops):
        if op.name in _VALUE_OPS and i + 1 < len(ops):
            out.append((pos, ops[i + 1][2]))
    return out


# what a value is replaced with, besides integers: other types in the same place
OTHER_VALUES = [b"N", b"\x88", b"]", b"}", b")", b"X\x01\x00\x00\x00x", b"G" + struct.pack(">d", 1e300),
                b"](K\x01K\x02e", b"}X\x01\x00\x00\x00kK\x01s"]


def _rewrite_zip(path: str, data_pkl: bytes) -> None:
    """Rewrite a torch.save zip with a new data.pkl, every other record as it was."""
    with zipfile.ZipFile(path) as zf:
        records = [(i.filename, zf.read(i)) for i in zf.infolist()]
    with zipfile.ZipFile(path, "w") as zf:
        for name, raw in records:
            zf.writestr(name, data_pkl if name.endswith("data.pkl") else raw)


def _data_pkl(path: str) -> bytes:
    with zipfile.ZipFile(path) as zf:
        name = next(n for n in zf.namelist() if n.endswith("data.pkl"))
        return zf.read(name)


# the fixtures with the fewest files (world size 2), one ZeRO-1 and one ZeRO-3
DS_FIXTURES = ["zero1_w2_fp32", "zero3_w2_fp32"]
_DS_FILES = {f: sorted(os.listdir(os.path.join(FIXTURES, f, "global_step2"))) for f in DS_FIXTURES}
_VALUES = {(f, n): _value_positions(_data_pkl(os.path.join(FIXTURES, f, "global_step2", n)))
         for f in DS_FIXTURES for n in _DS_FILES[f]}


@st.composite
def ds_mutations(draw):
    """(fixture, file name, mutation kind, mutation parameters)."""
    fixture = draw(st.sampled_from(DS_FIXTURES))
    name = draw(st.sampled_from(_DS_FILES[fixture]))
    kind = draw(st.sampled_from(["file_bytes", "pickle_bytes", "pickle_values", "pickle_values",
                                 "zip_fields"]))
    if kind == "pickle_values":
        n = len(_VALUES[(fixture, name)])
        edits = draw(st.lists(st.tuples(st.integers(0, n - 1),
                                        st.one_of(st.sampled_from(EDGE_INTS),
                                                  st.integers(-2**70, 2**70),
                                                  st.sampled_from(OTHER_VALUES))),
                              min_size=1, max_size=4))
    elif kind == "zip_fields":
        edits = draw(st.lists(st.tuples(st.sampled_from([b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06",
                                                         b"PK\x06\x06"]),
                                        st.integers(0, 40), st.sampled_from([2, 4, 8]),
                                        st.sampled_from([0, 1, 2**16 - 1, 2**32 - 1, 2**31, 2**64 - 1])),
                              min_size=1, max_size=3))
    else:
        edits = draw(st.lists(st.tuples(st.floats(0, 1, exclude_max=True),
                                        st.sampled_from(["set", "insert", "delete"]),
                                        st.binary(min_size=1, max_size=4)),
                              min_size=1, max_size=6))
    return fixture, name, kind, edits


def _mutate_bytes(raw: bytes, edits) -> bytes:
    buf = bytearray(raw)
    for frac, how, data in edits:
        at = int(frac * len(buf)) if buf else 0
        if how == "set":
            buf[at:at + len(data)] = data
        elif how == "insert":
            buf[at:at] = data
        else:
            del buf[at:at + len(data)]
    return bytes(buf)


def apply_ds_mutation(root: str, mutation) -> str:
    """Mutate one rank file of ``root`` (a copy of the mutation's fixture) in place;
    returns its path (``restore`` puts the original back)."""
    fixture, name, kind, edits = mutation
    path = os.path.join(root, "global_step2", name)
    raw = open(path, "rb").read()
    if kind == "file_bytes":
        raw = _mutate_bytes(raw, edits)
    elif kind == "pickle_bytes":
        _rewrite_zip(path, _mutate_bytes(_data_pkl(path), edits))
        return path
    elif kind == "pickle_values":
        pkl = _data_pkl(path)
        spans = _VALUES[(fixture, name)]
        # apply from the end so earlier positions stay valid
        for index, value in sorted(edits, key=lambda e: -spans[e[0]][0]):
            start, end = spans[index]
            raw_value = value if isinstance(value, bytes) else _encode_int(value)
            pkl = pkl[:start] + raw_value + pkl[end:]
            spans = spans[:index] + [(start, start + len(raw_value))] + spans[index + 1:]
        _rewrite_zip(path, pkl)
        return path
    else:
        buf = bytearray(raw)
        for sig, offset, width, value in edits:
            at = buf.rfind(sig) if sig != b"PK\x03\x04" else buf.find(sig)
            if at < 0:
                continue
            at += 4 + offset
            buf[at:at + width] = (value & ((1 << (8 * width)) - 1)).to_bytes(width, "little")
        raw = bytes(buf)
    with open(path, "wb") as f:
        f.write(raw)
    return path


def exercise_deepspeed(root: str) -> None:
    """Open, list and read the first elements of every state; only ALLOWED errors."""
    total = sum(os.path.getsize(os.path.join(root, "global_step2", n))
                for n in os.listdir(os.path.join(root, "global_step2")))
    try:
        with DeepSpeedSource(root, threads=2) as src:
            tensors = src.tensors()
            for t in tensors:
                for state, meta in t.states.items():
                    # what a consumer allocates for a state: never more than the files hold
                    assert meta.numel * meta.dtype.itemsize <= total, (
                        f"{t.name}.{state}: {meta.numel} elements declared, {total} bytes of files")
            for t in tensors:
                for state, meta in t.states.items():
                    n = min(meta.numel, READ_ELEMENTS)
                    src.read([ReadRequest(t.name, 0, bytearray(n * meta.dtype.itemsize), state)])
    except ALLOWED:
        pass


# -- our manifests -----------------------------------------------------------------------------

_MANIFEST_DIR = None


def manifest_fixture() -> str:
    """A small checkpoint generation written with tests/helpers/synthetic.py (built once)."""
    global _MANIFEST_DIR
    if _MANIFEST_DIR is None:
        import torch
        from helpers.synthetic import write_checkpoint
        root = tempfile.mkdtemp(prefix="fuzz-manifest-")
        g = torch.Generator().manual_seed(0)
        tensors = {
            "w": {"shape": [6, 4], "dtype": torch.float32, "optimizer": "muon",
                  "states": {"master": torch.randn(6, 4, generator=g), "momentum": torch.randn(6, 4, generator=g)}},
            "b": {"shape": [5], "dtype": torch.bfloat16, "optimizer": "adamw",
                  "states": {"param": torch.randn(5, generator=g).bfloat16(),
                             "exp_avg": torch.randn(5, generator=g), "exp_avg_sq": torch.rand(5, generator=g)}},
        }
        # small chunks: several per array (the readers walk chunk lists), little memory
        _MANIFEST_DIR = write_checkpoint(root, tensors, world_size=2, step=3, chunk_bytes=4096)
    return _MANIFEST_DIR


JSON_EDGE = [None, True, False, 0, 1, -1, 2, 2**31, 2**63, 10**30, -10**30, 1.5, float("inf"),
             "", "x", "float32", "bfloat16", "../x", "/etc", [], {}, [0], [2**62, 2**62],
             {"a": 1}, [[0, 1, 2]], [-1, 5]]


def _paths(doc, prefix=()):
    """Every (path, value) in a JSON document."""
    yield prefix, doc
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


@st.composite
def manifest_mutations(draw):
    n = len(list(_paths(_manifest_doc())))
    return draw(st.lists(st.tuples(st.integers(0, n - 1),
                                   st.sampled_from(["replace", "drop", "replace", "int"]),
                                   st.sampled_from(JSON_EDGE), st.integers(-2**64, 2**64)),
                         min_size=1, max_size=4))


_DOC = None


def _manifest_doc() -> dict:
    global _DOC
    if _DOC is None:
        with open(os.path.join(manifest_fixture(), "zarr.json")) as f:
            _DOC = json.load(f)
    return _DOC


def apply_manifest_mutation(doc: dict, edits) -> dict:
    doc = copy.deepcopy(doc)
    for index, how, value, number in edits:
        paths = list(_paths(doc))
        path, _ = paths[index % len(paths)]
        if not path:
            continue
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        if how == "drop":
            del parent[key]
        elif how == "int":
            parent[key] = number
        else:
            parent[key] = copy.deepcopy(value)
    return doc


def exercise_manifest(group: str, doc: dict) -> None:
    """parse_manifest on the mutated attributes, then OursSource on the group written
    with them: list, and read the first elements of every state. Only ALLOWED errors."""
    from offload_engine.formats.ours.reader import OursSource
    from offload_engine.formats.ours.tensor_table import parse_manifest
    where = os.path.join(group, "zarr.json")
    attrs = doc.get("attributes") if isinstance(doc, dict) else None
    if isinstance(attrs, dict):  # what read_manifest_attrs hands it (OursSource checks the rest)
        try:
            parse_manifest(attrs, "checkpoint", where)
        except ALLOWED:
            pass
    with open(where, "w") as f:
        json.dump(doc, f)
    try:
        with OursSource(group, "checkpoint", io_threads=1) as src:
            for t in src.tensors():
                for state, meta in t.states.items():
                    n = min(meta.numel, READ_ELEMENTS)
                    src.read([ReadRequest(t.name, 0, bytearray(n * meta.dtype.itemsize), state)])
    except ALLOWED:
        pass


# -- the targets -------------------------------------------------------------------------------

def _settings(n: int):
    return settings(max_examples=n, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck), print_blob=True)


def fuzz_deepspeed(n: int) -> None:
    # one copy of each fixture; an example mutates one file and puts it back after
    tmp = tempfile.mkdtemp(prefix="fuzz-ds-")
    roots = {f: shutil.copytree(os.path.join(FIXTURES, f), os.path.join(tmp, f)) for f in DS_FIXTURES}

    @_settings(n)
    @given(ds_mutations())
    def target(mutation):
        fixture, name = mutation[0], mutation[1]
        try:
            apply_ds_mutation(roots[fixture], mutation)
            exercise_deepspeed(roots[fixture])
        finally:
            shutil.copyfile(os.path.join(FIXTURES, fixture, "global_step2", name),
                            os.path.join(roots[fixture], "global_step2", name))
    try:
        target()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fuzz_manifest(n: int) -> None:
    doc0 = _manifest_doc()
    # one copy of the generation; every example rewrites only its zarr.json (the readers
    # never write)
    group = os.path.join(tempfile.mkdtemp(prefix="fuzz-gen-"), "gen")
    shutil.copytree(manifest_fixture(), group)

    @_settings(n)
    @given(manifest_mutations())
    def target(edits):
        exercise_manifest(group, apply_manifest_mutation(doc0, edits))
    try:
        target()
    finally:
        shutil.rmtree(os.path.dirname(group), ignore_errors=True)
        shutil.rmtree(os.path.dirname(manifest_fixture()), ignore_errors=True)


TARGETS = {"deepspeed": fuzz_deepspeed, "manifest": fuzz_manifest}


def own_peak_rss() -> int:
    """This process's peak RSS in bytes since exec (VmHWM). Not ru_maxrss: Linux keeps the
    forking parent's peak in it across exec, so under a large pytest process it reported
    the parent's size."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def main(argv: list[str]) -> int:
    target, n = argv[0], int(argv[1])
    TARGETS[target](n)
    peak = own_peak_rss()
    print(json.dumps({"target": target, "examples": n, "peak_rss": peak}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
