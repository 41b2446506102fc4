"""The device profile: which I/O settings move bytes fastest on the disk under a directory.

A short probe (``probe``) writes and reads a temporary file in the directory, through
``AsyncFileIO`` itself, for direct and buffered mode at a few queue depths, block sizes and
stream counts (``CASES``; at most ``PROBE_BYTES`` per case, page cache evicted before each read, writes
counted until their bytes are on the device), and keeps the fastest per direction. The
result is cached per device and file system (``st_dev`` major:minor, file system type,
mount point) in ``profile_dir()``: ``$OFFLOAD_ENGINE_PROFILE_DIR``, else
``$XDG_CACHE_HOME/offload-engine``, else ``~/.cache/offload-engine``. ``choose`` is what
the store, the consolidator, ``inspect --stats`` and ``bench io`` ask: the cached profile,
else a probe (saved when the cache is writable, kept for this process when not), else the
built-in default (io/settings.py) when probing is turned off (``OFFLOAD_ENGINE_IO_PROBE=0``:
the test suite does this so that no test probes by accident) or fails.

File systems without O_DIRECT (tmpfs) get buffered mode without measuring direct.
``offload-engine bench disk --refresh-profile --path DIR`` probes again and replaces the
cached entry (docs/store.md, "I/O settings").
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import stat
import statistics
import tempfile
import threading
import time
import uuid

from ..envflags import env_flag
from ..errors import InputError
from ..jsonlimits import file_kind, parse_json
from ..units import MiB
from . import syscalls
from .align import ALIGN
from .errors import FileIOError
from .profile_check import FORMAT, check_profile
from .settings import DEFAULT, DIRECTIONS, DirectionSettings

log = logging.getLogger(__name__)


FORMAT_VERSION = 2  # 2: points and choices have "streams" (a version-1 profile is probed again)
PROFILE_DIR_ENV = "OFFLOAD_ENGINE_PROFILE_DIR"
PROBE_ENV = "OFFLOAD_ENGINE_IO_PROBE"  # 0/false/no/off: never probe (cache or built-in default)
MAX_CACHE_BYTES = 1 * MiB  # a probe writes ~10 KB
MAX_CACHE_DEPTH = 8  # a probe's profile nests 3 deep
PROBE_BYTES = 256 * MiB  # bytes moved per case and direction
REQUEST_BYTES = 32 * MiB  # bytes per request, all submitted at once (as the store's read-ahead)
# (mode, queue depth, block size, streams): the points `bench disk` found to matter on our
# disks, then direct with one piece from each of as many requests as pieces in flight
# (streams = queue depth: as many regions of the disk busy as there can be at that depth).
# On this VM's virtual disk, 8 GiB of 64 MiB chunk files read at 1.0-1.3 GB/s one chunk
# after another whatever the depth, 1.2-1.5 GB/s from 8 chunks at once and 1.4-1.6 GB/s
# from 16 at once (QD 16 x 4 MiB; three scripts, 3-4 alternating runs each, page cache
# dropped, 2026-12-02), while the probe's 256 MiB shows them within its noise.
CASES = (tuple((mode, qd, bs, 1) for mode in ("direct", "buffered")
               for qd, bs in ((4, 8 * MiB), (8, 8 * MiB), (16, 1 * MiB), (32, 1 * MiB)))
         + (("direct", 8, 8 * MiB, 8), ("direct", 16, 4 * MiB, 16)))
# within this fraction of the fastest, the preferred case wins (``_preference``: less CPU,
# and for reads more streams): noise must not flip the choice
TIE = 0.05
# buffered I/O copies every byte through the page cache: 3-7x the CPU of O_DIRECT per byte
# (the 2-vCPU VM, probes of 2026-12-02: writes 0.36-0.64 vs 0.06-0.17 CPU-s per GB, reads
# 0.54-0.74 vs 0.07-0.17), CPU a training step needs. So buffered wins a direction only
# when its typical point is this much faster than direct's, as when the disk changed on
# 2026-12-01 (buffered reads 0.93 GB/s against direct 0.58); a few percent, or one
# buffered case out of four that ran fast once (3.31 GB/s among 2.0-2.4), is not worth 4x
# the CPU.
BUFFERED_MARGIN = 0.25
PASSES = 2  # contending cases measured twice, the second pass in reverse order: a disk whose
#             speed drifts during the probe favours neither the first cases nor the last
# after the first pass, only cases within this fraction of the fastest case (either
# direction, any mode) are measured again; the others keep their one-pass figures. To
# overtake the fastest on a second look such a case would have to gain more than this
# plus TIE on it in one pass; the buffered cases, the slowest to measure here, were 20-45%
# behind in every probe of 2026-12-02 (the probe took 8-12.6 s with every case twice)
CONTEND = 0.15
MEMORY_FS = ("tmpfs", "ramfs")  # no device behind them: O_DIRECT there would only add a copy

probes_run = 0  # probes run by this process (tests check that a cached profile is reused)
_memo: dict[str, dict] = {}  # profiles of this process, by key (for an unwritable cache)
_memo_lock = threading.Lock()


# -- where: device and file system ---------------------------------------------------------
def mount_of(path: str) -> tuple[str, str]:
    """(mount point, file system type) of the mount holding ``path`` (/proc/mounts);
    ("?", "unknown") where that cannot be read."""
    try:
        text = syscalls.read_all("/proc/mounts").decode(errors="replace")
    except OSError:
        return "?", "unknown"
    real = os.path.realpath(path)
    best = ("?", "unknown")
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        if real == mnt or real.startswith(mnt.rstrip("/") + "/"):
            if best[0] == "?" or len(mnt) >= len(best[0]):
                best = (mnt, parts[2])
    return best


def profile_key(path: str) -> dict:
    """What a profile is cached by: the device number, the file system type and its mount."""
    st = os.stat(path)
    mount, fstype = mount_of(path)
    return {"dev": f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}", "fs_type": fstype,
            "mount": mount}


def _key_name(key: dict) -> str:
    mount = re.sub(r"[^A-Za-z0-9_.-]+", "_", key["mount"]).strip("_") or "root"
    return f"io-{key['dev'].replace(':', '-')}-{key['fs_type']}-{mount}"


def profile_dir() -> str:
    """Where profiles are cached (see the module's docstring)."""
    if os.environ.get(PROFILE_DIR_ENV):
        return os.environ[PROFILE_DIR_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "offload-engine")


def profile_file(path: str) -> str:
    """The cache file of the profile for ``path``'s device and file system."""
    return os.path.join(profile_dir(), _key_name(profile_key(path)) + ".json")


# -- the cache ---------------------------------------------------------------------------
def load(path: str) -> dict | None:
    """The cached profile for ``path``, or None: none there, or one that is unreadable, of
    another format, or breaks a rule of ``check_profile`` (not a regular file, over
    ``MAX_CACHE_BYTES``, not strict JSON, nested, wrong types, values out of range). A bad
    cache is ignored with a warning naming it (and probed again, or the defaults used),
    never trusted and never a crash: anyone who can write the cache folder wrote it."""
    try:
        file = profile_file(path)
        mode = os.stat(file).st_mode
    except OSError:
        return None  # no cache entry (or no folder): nothing to warn about
    try:
        if not stat.S_ISREG(mode):
            raise InputError(f"{file}: is {file_kind(mode)}, not a regular file")
        raw = syscalls.read_all(file, limit=MAX_CACHE_BYTES, flags=os.O_NONBLOCK)
        if len(raw) > MAX_CACHE_BYTES:
            raise InputError(f"{file}: more than {MAX_CACHE_BYTES} bytes")
        doc = parse_json(raw, file, max_depth=MAX_CACHE_DEPTH)
        if isinstance(doc, dict) and doc.get("format") == FORMAT and \
                doc.get("format_version") != FORMAT_VERSION:
            return None  # an older version's profile: probed again, as documented
        check_profile(doc, file)
    except (OSError, ValueError) as e:
        log.warning("ignoring a bad I/O profile cache entry (probed again, or the defaults "
                    "used): %s", _short(e))
        return None
    doc["file"] = file
    return doc


def _short(e: Exception) -> str:
    text = str(e)
    return text if len(text) <= 300 else text[:300] + "..."


def save(path: str, profile: dict) -> str:
    """Write ``profile`` as the cache entry of ``path``'s device (atomically); its file."""
    target = profile_file(path)
    syscalls.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = f"{target}.{uuid.uuid4().hex}.tmp"
    fd = syscalls.open_fd(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | syscalls.NOFOLLOW
                          | syscalls.CLOEXEC, 0o644)
    try:
        try:
            syscalls.write_all(fd, (json.dumps(profile, indent=2) + "\n").encode(), tmp)
        finally:
            os.close(fd)
        syscalls.replace(tmp, target)
    except BaseException:
        try:
            syscalls.unlink(tmp)
        except OSError:
            pass
        raise
    return target


def settings_of(profile: dict, op: str, source: str = "profile") -> DirectionSettings:
    """The profile's choice for ``op`` ("read" or "write")."""
    d = profile[op]
    return DirectionSettings(str(d["mode"]), int(d["queue_depth"]), int(d["block_bytes"]), source,
                             int(d.get("streams", 1)))


# -- the choice -----------------------------------------------------------------------------
def choose(path: str, *, refresh: bool = False, probe_allowed: bool | None = None,
           progress=None) -> dict:
    """The profile to use for files under ``path`` (a directory that exists).

    The cached one; else (or with ``refresh``) a new probe, saved to the cache (when the
    cache cannot be written, kept for this process only); else, when probing is turned
    off (``probe_allowed`` False, default: ``OFFLOAD_ENGINE_IO_PROBE`` is not an "off"
    spelling, ``envflags.parse_flag``) or
    fails, the built-in default. The result has "read" and "write" settings and "source":
    "cache", "probe" or "default". ``progress``: passed to ``probe``.
    """
    if probe_allowed is None:
        probe_allowed = env_flag(PROBE_ENV, True)
    try:
        key = _key_name(profile_key(path))
    except OSError:
        return default_profile()
    if not refresh:
        with _memo_lock:
            if key in _memo:
                return _memo[key]
        cached = load(path)
        if cached is not None:
            cached["source"] = "cache"
            return cached
    if not probe_allowed:
        return default_profile()
    lock_fd = _lock(key)  # ranks of one machine starting together: one probes, the rest read
    try:
        if not refresh and lock_fd is not None:
            cached = load(path)
            if cached is not None:
                cached["source"] = "cache"
                return cached
        try:
            result = probe(path, progress=progress)
        except Exception as e:  # a disk that cannot be measured is used with the defaults
            log.warning("I/O profile probe in %s failed (%s); using the built-in defaults",
                        path, e)
            return default_profile()
        try:
            result["file"] = save(path, result)
        except OSError as e:
            log.warning("I/O profile of %s not cached (%s): %s", path, profile_dir(), e)
        result["source"] = "probe"
        with _memo_lock:
            _memo[key] = result
        return result
    finally:
        if lock_fd is not None:
            os.close(lock_fd)  # releases the flock


def _lock(key: str) -> int | None:
    """An exclusive flock on the cache's lock file for ``key`` (waits for another process's
    probe); None where the cache directory cannot be written (then no one waits)."""
    import fcntl

    try:
        syscalls.makedirs(profile_dir(), exist_ok=True)
        fd = syscalls.open_fd(os.path.join(profile_dir(), f".{key}.lock"),
                              os.O_RDWR | os.O_CREAT | syscalls.NOFOLLOW | syscalls.CLOEXEC, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        return None
    return fd


def reader_settings(path: str, queue_depth: int, block_bytes: int = DEFAULT.block_bytes,
                    mode: str | None = None) -> DirectionSettings:
    """Read settings for an offline reader of files under ``path`` (consolidate, inspect):
    the cached profile's read choice (source "profile"), never a probe (the files may be on
    read-only media, and a reader should not write next to them); without one, ``mode``
    (default "direct") at ``queue_depth`` and ``block_bytes`` (source "default")."""
    if mode is None:
        try:
            cached = load(path if os.path.isdir(path) else os.path.dirname(path) or ".")
        except OSError:
            cached = None
        if cached is not None:
            return settings_of(cached, "read", "profile")
    return DirectionSettings(mode or "direct", queue_depth, block_bytes, "default")


def default_profile() -> dict:
    """The built-in settings, in a profile's shape (source "default")."""
    return {"source": "default", **{op: {k: v for k, v in DEFAULT.as_dict().items()
                                         if k != "source"} for op in DIRECTIONS}}


def forget_memo() -> None:
    """Drop the profiles this process probed without caching (tests)."""
    with _memo_lock:
        _memo.clear()


# -- the probe ----------------------------------------------------------------------------
def probe(path: str, *, size: int | None = None, cases=None, passes: int | None = None,
          progress=None) -> dict:
    """Measure ``cases`` (default ``CASES``) on a temporary file in directory ``path``
    (removed after), up to ``passes`` times each (default ``PASSES``; every other pass in
    reverse order; after the first, only the ``contenders``); the choice per direction
    (``pick``), every point (GB/s and CPU seconds per GB of this process over its passes),
    and how long it took. ``size``: bytes per case and direction
    (default ``PROBE_BYTES``, rounded down to whole requests). Figures are GB/s (1e9
    bytes/s). Memory file systems (tmpfs, ramfs) and those that refuse O_DIRECT are
    measured, and chosen, buffered only. ``progress(done, total)``: bytes moved so
    far, of at most all (a later pass measures fewer cases: the total shrinks then)."""
    global probes_run
    from .buffer_pool import BufferPool
    from .direct_probe import probe_direct
    from .file_io import AsyncFileIO
    from .page_cache import evict

    t0 = time.monotonic()
    size = size or PROBE_BYTES
    passes = max(1, passes or PASSES)
    cases = list(cases or CASES)
    request = min(REQUEST_BYTES, size)
    size = max(request, size // request * request)
    direct_ok = probe_direct(path, strict=False) and mount_of(path)[1] not in MEMORY_FS
    if not direct_ok:
        cases = [c for c in cases if c[0] == "buffered"] or [("buffered", DEFAULT.queue_depth,
                                                              DEFAULT.block_bytes, 1)]
    free = shutil.disk_usage(path).free
    if free < size + 64 * MiB:
        raise FileIOError(errno.ENOSPC, "probe", path, detail=f"{free} bytes free, the probe "
                          f"needs {size + 64 * MiB}")
    workdir = tempfile.mkdtemp(prefix=".oe-io-probe-", dir=path)
    file = os.path.join(workdir, "data")
    runs = [{"write": [], "read": []} for _ in cases]  # per case: (wall, cpu) seconds per pass
    requests = [_request_bytes(size, request, streams) for _mode, _qd, _bs, streams in cases]
    pool = BufferPool(request, pin=False)
    moved = [0, size * (1 + 2 * len(cases) * passes)]  # bytes done, of at most

    def count(nbytes: int) -> None:
        moved[0] += nbytes
        if progress is not None:
            progress(*moved)

    try:
        buf = pool.acquire(request)
        buf.bytes.view(-1)[:] = 0x5A  # not zeros: no file system shortcut
        with AsyncFileIO(threads=4, queue_depth=4, block_size=8 * MiB) as io0:
            io0.preallocate(file, size)
            # written once, untimed: the first write into preallocated (unwritten) extents
            # also pays the file system's conversion of them, which would fall on the first
            # case only; the store overwrites written blocks every step
            _timed(io0, file, buf, size, request, write=True)
            count(size)
        measured = list(range(len(cases)))
        for n in range(passes):
            if n:
                measured = contenders(_points(cases, requests, runs, size), measured)
                moved[1] = moved[0] + 2 * size * len(measured) * (passes - n)
            for i in (measured if n % 2 == 0 else reversed(measured)):
                mode, qd, bs, streams = cases[i]
                req = requests[i]
                st = DirectionSettings(mode, qd, min(bs, req), "probe", streams)
                with AsyncFileIO(threads=qd, read=st, write=st) as io:
                    runs[i]["write"].append(_timed(io, file, buf, size, req, write=True))
                    count(size)
                    evict([file])
                    runs[i]["read"].append(_timed(io, file, buf, size, req, write=False))
                    count(size)
        buf.release()
        points = _points(cases, requests, runs, size)
    finally:
        pool.close()
        try:
            syscalls.rmtree(workdir)
        except OSError:
            pass
    probes_run += 1
    out = {"format": FORMAT, "format_version": FORMAT_VERSION, "key": profile_key(path),
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "bytes_per_case": size,
           "request_bytes": request, "direct_supported": bool(direct_ok), "passes": passes,
           "probe_s": None, "points": points}
    for op in DIRECTIONS:
        out[op] = pick(points, op)
    out["probe_s"] = round(time.monotonic() - t0, 2)
    return out


def _points(cases: list, requests: list[int], runs: list[dict], size: int) -> list[dict]:
    """One point per case: its settings, the mean GB/s and CPU seconds per GB of its
    passes so far per direction, and how many passes it had."""
    points = []
    for i, (mode, qd, bs, streams) in enumerate(cases):
        point = {"mode": mode, "queue_depth": qd, "block_bytes": min(bs, requests[i]),
                 "streams": streams, "passes": len(runs[i]["read"])}
        for op in ("write", "read"):
            wall = statistics.mean(t for t, _cpu in runs[i][op])
            cpu = statistics.mean(c for _t, c in runs[i][op])
            point[f"{op}_gbps"] = round(size / wall / 1e9, 4)
            point[f"{op}_cpu_s_per_gb"] = round(cpu / (size / 1e9), 4)
        points.append(point)
    return points


def contenders(points: list[dict], indices) -> list[int]:
    """Those of ``indices`` (into ``points``) worth another pass: within ``CONTEND`` of the
    fastest of them in either direction, in their given order."""
    best = {op: max(points[i][f"{op}_gbps"] for i in indices) for op in DIRECTIONS}
    return [i for i in indices
            if any(points[i][f"{op}_gbps"] >= (1 - CONTEND) * best[op] for op in DIRECTIONS)]


def pick(points: list[dict], op: str) -> dict:
    """The point for ``op``. First the mode: buffered only when its points' median GB/s
    beats the direct points' median by more than ``BUFFERED_MARGIN`` (it costs several
    times the CPU; medians, so that one lucky case on a noisy disk does not decide). Then,
    among that mode's points, the first within ``TIE`` of the fastest in ``_preference``'s
    order."""
    key = f"{op}_gbps"
    direct = [p for p in points if p["mode"] == "direct"]
    buffered = [p for p in points if p["mode"] != "direct"]
    pool = points
    if direct and buffered:
        typical_direct = statistics.median(p[key] for p in direct)
        typical_buffered = statistics.median(p[key] for p in buffered)
        pool = buffered if typical_buffered > (1 + BUFFERED_MARGIN) * typical_direct else direct
    best = max(p[key] for p in pool)
    for p in _preference(pool, op):
        if p[key] >= (1 - TIE) * best:
            return {"mode": p["mode"], "queue_depth": p["queue_depth"],
                    "block_bytes": p["block_bytes"], "streams": p.get("streams", 1),
                    "gbps": p[key]}
    raise AssertionError("unreachable")


def _preference(points: list[dict], op: str) -> list[dict]:
    """``points`` in the order that wins ties (points within ``TIE`` of the fastest).

    Fewest CPU seconds per GB first: the CPU a training step needs, and on the 2-vCPU VM
    the cheap cases were also the fast ones at scale (8 GiB writes at QD 16 x 1 MiB, tied
    in the probe at 0.09 CPU-s per GB, reached 0.83x fio's speed at that shape; at
    8 MiB pieces and 8 streams, 0.04 CPU-s per GB, 1.02-1.11x). For reads, more streams
    before that: spreading reads over more regions gained at scale in every run measured
    (8 GiB of chunk files, see ``CASES``), which the probe's 256 MiB is too small to show
    beyond its noise; where the probe does see fewer streams ahead by more than ``TIE``,
    they win. Points without CPU figures keep their listed order (stable sort)."""
    def cost(p: dict) -> float:
        return float(p.get(f"{op}_cpu_s_per_gb", 0.0))

    if op == "read":
        return sorted(points, key=lambda p: (-int(p.get("streams", 1)), cost(p)))
    return sorted(points, key=cost)


def _request_bytes(size: int, request: int, streams: int) -> int:
    """Bytes per request of a case with ``streams`` streams: ``request``, halved until
    ``size`` (a multiple of ``request``) holds a request per stream, else some streams would
    have nothing to serve; never below ``ALIGN``, so O_DIRECT alignment holds."""
    while size // request < streams and request % (2 * ALIGN) == 0:
        request //= 2
    return request


def _timed(io, file: str, buf, size: int, request: int, write: bool) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) to move ``size`` bytes in
    ``request``-byte requests all submitted at once; a write run ends when its bytes are
    on the device (fdatasync)."""
    c0 = time.process_time()
    t0 = time.perf_counter()
    futures = [io.write(file, off, buf, length=request) if write
               else io.read(file, off, buf, length=request) for off in range(0, size, request)]
    for f in futures:
        f.result()
    if write:
        io.sync(file).result()
    return time.perf_counter() - t0, time.process_time() - c0
