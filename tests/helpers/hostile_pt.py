"""Hostile ``torch.save``-shaped files, built by hand (no torch), and a meter of the memory
reading each one costs.

Each payload is a small file that tries to make a reader allocate far more than its own
size: a deflated ``data.pkl`` that inflates to gigabytes, a pickle that calls an allowed
callable with a huge integer, pickle opcodes whose length or memo-index fields ask the
C unpickler to allocate before it reads, cheap opcodes that each build a large object,
zip directories of many entries, and forged tensor metadata. ``PAYLOADS`` maps a name to a
function ``build(path)``; tests import them, and running this file measures each:

    PYTHONPATH=$PWD python tests/helpers/hostile_pt.py [--limit-gib 4] [NAME ...]

prints, per payload, what ``load_pt`` raised and the peak RSS of a child process that did
nothing else (limited with RLIMIT_AS so that an unfixed reader fails with MemoryError
instead of taking the machine down).
"""

from __future__ import annotations

import io
import json
import os
import resource
import struct
import subprocess
import sys
import zipfile
import zlib

PREFIX = "archive/"


# -- a tiny pickle assembler (protocol 2 opcodes, written by hand) ---------------------------

def glob(module: str, name: str) -> bytes:
    """GLOBAL: push ``module.name`` (resolved through ``find_class``)."""
    return b"c" + f"{module}\n{name}\n".encode()


def uni(s: str) -> bytes:
    """BINUNICODE: push a str."""
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def integer(n: int) -> bytes:
    """BININT for 32-bit values, else LONG1/LONG4 (two's complement, little endian)."""
    if -2**31 <= n < 2**31:
        return b"J" + struct.pack("<i", n)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return (b"\x8a" + bytes([len(raw)]) if len(raw) < 256 else b"\x8b" + struct.pack("<i", len(raw))) + raw


def tup(*items: bytes) -> bytes:
    """MARK items TUPLE."""
    return b"(" + b"".join(items) + b"t"


def call(func: bytes, *args: bytes) -> bytes:
    """func(*args): REDUCE."""
    return func + tup(*args) + b"R"


def dict_of(pairs: list[tuple[bytes, bytes]]) -> bytes:
    """EMPTY_DICT MARK k v ... SETITEMS."""
    return b"}(" + b"".join(k + v for k, v in pairs) + b"u"


def pkl(body: bytes) -> bytes:
    """PROTO 2, the body (one object), STOP."""
    return b"\x80\x02" + body + b"."


def storage(key: str, marker: str = "FloatStorage", numel: int = 4) -> bytes:
    """BINPERSID of torch.save's ('storage', torch.<marker>, key, 'cpu', numel)."""
    return tup(uni("storage"), glob("torch", marker), uni(key), uni("cpu"), integer(numel)) + b"Q"


def tensor(key: str, shape: tuple, stride: tuple, offset: int = 0, numel: int = 4) -> bytes:
    """torch._utils._rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())."""
    return call(glob("torch._utils", "_rebuild_tensor_v2"), storage(key, numel=numel), integer(offset),
                tup(*map(integer, shape)), tup(*map(integer, stride)), b"\x89",
                call(glob("collections", "OrderedDict")))


# -- the zip container ------------------------------------------------------------------------

def write_pt(path: str, data_pkl: bytes, storages: dict[str, bytes] | None = None,
             compress_pkl: bool = False) -> None:
    """A zip laid out as torch.save lays it out (``archive/data.pkl``, ``archive/byteorder``,
    ``archive/data/<key>``), records stored; ``compress_pkl`` deflates data.pkl."""
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(PREFIX + "data.pkl", data_pkl,
                    compress_type=zipfile.ZIP_DEFLATED if compress_pkl else zipfile.ZIP_STORED)
        zf.writestr(PREFIX + "byteorder", b"little")
        for key, raw in (storages or {}).items():
            zf.writestr(PREFIX + "data/" + key, raw)


def _deflate_bomb(pkl_prefix: bytes, zeros: int, suffix: bytes) -> tuple[bytes, int, int]:
    """(raw deflate stream, inflated size, crc32) of prefix + ``zeros`` zero bytes + suffix,
    built piece by piece (never holding the inflated bytes)."""
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    out = [comp.compress(pkl_prefix)]
    crc = zlib.crc32(pkl_prefix)
    piece = bytes(16 << 20)
    left = zeros
    while left:
        n = min(left, len(piece))
        out.append(comp.compress(piece[:n]))
        crc = zlib.crc32(piece[:n], crc)
        left -= n
    out.append(comp.compress(suffix))
    crc = zlib.crc32(suffix, crc)
    out.append(comp.flush())
    return b"".join(out), len(pkl_prefix) + zeros + len(suffix), crc


def write_deflated_bomb(path: str, inflated: int) -> None:
    """A torch.save-shaped zip whose data.pkl is deflated: a valid pickle (one BINBYTES8 of
    ``inflated`` zero bytes) that inflates about 1000 times (4.3 GB from a 4.2 MB file)."""
    head = b"\x80\x02\x8e" + struct.pack("<Q", inflated)
    raw, size, crc = _deflate_bomb(head, inflated, b".")
    name = (PREFIX + "data.pkl").encode()
    local = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 45, 0, 8, 0, 0x21, crc,
                        0xFFFFFFFF, 0xFFFFFFFF, len(name), 20)
    zip64_local = struct.pack("<HHQQ", 1, 16, size, len(raw))
    central = struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 45, 45, 0, 8, 0, 0x21, crc,
                          0xFFFFFFFF, 0xFFFFFFFF, len(name), 20, 0, 0, 0, 0, 0)
    zip64_central = struct.pack("<HHQQ", 1, 16, size, len(raw))
    with open(path, "wb") as f:
        f.write(local + name + zip64_local)
        f.write(raw)
        cd_start = f.tell()
        f.write(central + name + zip64_central)
        cd_size = f.tell() - cd_start
        eocd64_at = f.tell()
        f.write(struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, 1, 1, cd_size, cd_start))
        f.write(struct.pack("<4sIQI", b"PK\x06\x07", 0, eocd64_at, 1))
        f.write(struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 1, 1, cd_size, cd_start, 0))


def write_many_entries(path: str, entries: int) -> None:
    """A zip whose central directory lists ``entries`` empty storage records (each ~60
    bytes of directory): ``zipfile`` makes an object of several hundred bytes for each."""
    body = io.BytesIO()
    names = []
    pk = pkl(b"N")
    name = (PREFIX + "data.pkl").encode()
    body.write(struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, 0, 0, 0x21,
                           zlib.crc32(pk), len(pk), len(pk), len(name), 0) + name + pk)
    names.append((name, 0, zlib.crc32(pk), len(pk)))
    for i in range(entries):
        names.append((f"{PREFIX}data/{i}".encode(), 0, 0, 0))  # every one points at record 0
    cd_start = body.tell()
    for n, offset, crc, size in names:
        body.write(struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 20, 20, 0, 0, 0, 0x21, crc,
                               size, size, len(n), 0, 0, 0, 0, 0, offset) + n)
    cd_size = body.tell() - cd_start
    count = min(len(names), 0xFFFF)
    body.write(struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, count, count, cd_size, cd_start, 0))
    with open(path, "wb") as f:
        f.write(body.getvalue())


# -- the payloads ------------------------------------------------------------------------------

GIB = 1 << 30


def _simple(body: bytes):
    return lambda path: write_pt(path, pkl(body))


def _empty_sets(path: str, n: int = 4 << 20) -> None:
    # a list of n empty sets: one byte of pickle each, 216 bytes of set each
    write_pt(path, pkl(b"](" + b"\x8f" * n + b"e"))


def _inert_classes(path: str, n: int = 100_000) -> None:
    # n distinct DeepSpeed-looking class names: every one a new stand-in class (~1 KB)
    body = b"](" + b"".join(glob("deepspeed.x", f"C{i}") for i in range(n)) + b"e"
    write_pt(path, pkl(body))


def _dtype_build(path: str) -> None:
    # BUILD on the shared torch.float32 entry of our dtype table: itemsize 1 for the process
    body = glob("torch", "float32") + dict_of([(uni("itemsize"), integer(1))]) + b"b"
    write_pt(path, pkl(body))


def _tensor_build(path: str) -> None:
    # a tensor checked against its storage, then its shape replaced by BUILD
    t = tensor("0", (4,), (1,))
    body = t + dict_of([(uni("shape"), tup(integer(2**62)))]) + b"b"
    write_pt(path, pkl(body), {"0": bytes(16)})


def _tensor_forged(path: str) -> None:
    # a 16-byte storage declared as 2**61 elements, viewed as a 2**31 x 2**31 tensor
    body = tensor("0", (2**31, 2**31), (2**31, 1), numel=2**61)
    write_pt(path, pkl(body), {"0": bytes(16)})


def _shape_cpu(path: str, dims: int = 200_000) -> None:
    # a shape of many huge dimensions: their product costs minutes of CPU (quadratic)
    body = call(glob("torch", "Size"), tup(b"(" + integer(2**62 + 1) * dims + b"t"))
    write_pt(path, pkl(body))


def _set_of_memo_list(path: str, items: int = 100_000, copies: int = 1000) -> None:
    # one list of 100,000 ints kept in the memo, then set(list) 1000 times: 6 bytes of
    # pickle each, 4 MB of set each
    body = (b"]" + b"q\x00" + b"(" + b"".join(integer(1000 + i) for i in range(items)) + b"e"
            + b"]" + b"(" + glob("builtins", "set") + b"q\x01" + b"0"
            + (b"h\x01" + b"h\x00" + b"\x85" + b"R") * copies + b"e" + b"\x86")
    write_pt(path, pkl(body))


def _deep_tuple(path: str, depth: int = 1_000_000) -> None:
    # a tuple nested a million deep used as a dict key: hashing it recurses in C
    write_pt(path, pkl(b"}" + b")" + b"\x85" * depth + b"N" + b"s"))


PAYLOADS = {
    # the two
    "deflated_data_pkl": lambda path: write_deflated_bomb(path, 4300 << 20),
    "bytearray_int": _simple(call(glob("builtins", "bytearray"), integer(3_000_000_000))),
    # opcodes whose fields make the C unpickler allocate before it reads
    "memo_long_binput": _simple(b"N" + b"r" + struct.pack("<I", 2**31 - 1)),
    "memo_text_put": _simple(b"N" + b"p99999999999\n"),
    "binbytes8_length": _simple(b"\x8e" + struct.pack("<Q", 16 * GIB) + b"x"),
    "bytearray8_length": lambda path: write_pt(
        path, b"\x80\x05\x96" + struct.pack("<Q", 16 * GIB) + b"x."),
    "binunicode8_length": _simple(b"\x8d" + struct.pack("<Q", 16 * GIB) + b"x"),
    "frame_length": lambda path: write_pt(path, b"\x80\x04\x95" + struct.pack("<Q", 16 * GIB) + b"N."),
    "long4_length": _simple(b"\x8b" + struct.pack("<i", 2**31 - 1) + b"\x01"),
    # cheap opcodes that each build a large object
    "empty_sets": _empty_sets,
    "inert_classes": _inert_classes,
    "set_of_memo_list": _set_of_memo_list,
    "deep_tuple": _deep_tuple,
    # zip directories
    "many_zip_entries": lambda path: write_many_entries(path, 2_000_000),
    # forged tensor metadata
    "tensor_forged_sizes": _tensor_forged,
    "tensor_build_after_check": _tensor_build,
    "dtype_build": _dtype_build,
    "shape_product_cpu": _shape_cpu,
}


# -- the meter -----------------------------------------------------------------------------------

_CHILD = r"""
import json, resource, sys, time
from offload_engine import dtypes
from offload_engine.formats.safe_unpickler import load_pt
t = time.perf_counter()
try:
    load_pt(sys.argv[1])
    outcome = "loaded"
except BaseException as e:
    outcome = f"{type(e).__name__}: {str(e)[:200]}"
if dtypes.FLOAT32.itemsize != 4:
    outcome += f" [float32 itemsize is now {dtypes.FLOAT32.itemsize} in this process]"
# VmHWM: this process's own peak since exec. ru_maxrss keeps the forking parent's peak across
# exec on Linux: a child of a large pytest process would report the parent's size.
with open("/proc/self/status") as f:
    hwm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
print(json.dumps({"outcome": outcome, "seconds": round(time.perf_counter() - t, 2),
                  "peak_rss": hwm}))
"""


def measure(path: str, limit_bytes: int, timeout: float = 300) -> dict:
    """Run ``load_pt(path)`` in a child limited to ``limit_bytes`` of address space
    (RLIMIT_AS); returns its outcome (what it raised), seconds, and peak RSS in bytes."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    env = dict(os.environ, MALLOC_ARENA_MAX="2")
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, path], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=limit, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"outcome": f"still running after {timeout:.0f} s (killed)", "peak_rss": None}
    if not out.strip():
        return {"outcome": f"died (rc {proc.returncode}): {err.decode()[-200:]}", "peak_rss": None}
    return json.loads(out)


def main(argv: list[str]) -> int:
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description="peak RSS of load_pt on each hostile payload")
    ap.add_argument("names", nargs="*", default=list(PAYLOADS))
    ap.add_argument("--limit-gib", type=float, default=4.0, help="RLIMIT_AS of the child")
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.names:
            path = os.path.join(tmp, name + ".pt")
            PAYLOADS[name](path)
            r = measure(path, int(args.limit_gib * GIB), args.timeout)
            rss = "-" if r.get("peak_rss") is None else f"{r['peak_rss'] / (1 << 20):.0f} MiB"
            print(f"{name:26s} file {os.path.getsize(path):>11,d} B  peak RSS {rss:>9s}  "
                  f"{r.get('seconds', '-')} s  {r['outcome']}", flush=True)
            os.unlink(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
