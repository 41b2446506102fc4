"""The one interface every checkpoint format is read through: ``TensorSource``.

A source lists its *logical tensors* from metadata only (``tensors()``): a parameter, a
buffer, or a flat array of a store that records no tensors, each with its global shape
and one or more *states*: ``param`` (the parameter's values), ``master`` (DeepSpeed's fp32
master copy), ``master_param`` (ZeroMuon's), ``momentum_buffer`` (Muon), ``exp_avg`` /
``exp_avg_sq`` (Adam), or, for a bare store array, the array's own name. ``read`` fills
element ranges of a state's flattened elements, reassembled from however the format
shards them, for any number of requests at once (a batch lets a reader merge neighbouring
reads). Tied names are ``aliases()`` of the tensor written in their place.

Everyone reads through it: ``checkpoint.load`` (our generations), and the offline tools
(consolidate, inspect, diff, export). Nothing here imports torch: dtypes are
``offload_engine.dtypes.DType``; ``read`` fills any writable buffer: a numpy array, a CPU
torch tensor or a memoryview, of the state's dtype or raw bytes of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..dtypes import DType, dtype as as_dtype
from ..units import MiB
from .errors import FormatError

# The state that stands for the tensor's value, in order of preference ("weights": diff and
# export); ``master_param`` is torch's (and ZeroMuon's) key for the fp32 master copy.
WEIGHT_STATES = ("master", "master_param", "param")
# The state consolidate writes: the fp32 masters where the run kept them (DeepSpeed's
# ``master``, ZeroMuon's ``master_param`` with master_weights=True), else the parameter.
VALUE_STATES = ("master", "master_param", "param")


@dataclass
class StateMeta:
    """One state of one tensor: stored dtype, elements, and bytes held by each rank.

    ``bytes_by_rank`` keys are ranks (ints), or None where the input has no ranks
    (safetensors, an unsharded DeepSpeed buffer).
    """

    dtype: DType
    numel: int
    bytes_by_rank: dict = field(default_factory=dict)

    def __post_init__(self):
        self.dtype = as_dtype(self.dtype)

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_by_rank.values())


@dataclass
class TensorMeta:
    """A logical tensor: ``kind`` is "param", "frozen" (a parameter without gradient),
    "buffer", or "array" (a store array listed without a tensor table; ``home`` is then its
    tier). ``dtype`` is the tensor's own dtype (its parameter's, or for DeepSpeed its fp32
    master's); each state has its own."""

    name: str
    shape: tuple[int, ...]
    dtype: DType
    optimizer: str | None
    states: dict[str, StateMeta]
    kind: str = "param"
    home: str | None = None
    extra: dict = field(default_factory=dict)  # what the format records besides (adam_step)

    def __post_init__(self):
        self.dtype = as_dtype(self.dtype)

    @classmethod
    def single(cls, name: str, shape, dtype, kind: str = "param", state: str = "param",
               rank=None) -> "TensorMeta":
        """A tensor with one state (a safetensors entry, a frozen weight, a buffer)."""
        dt = as_dtype(dtype)
        numel = math.prod(shape)
        return cls(name, tuple(shape), dt, None,
                   {state: StateMeta(dt, numel, {rank: numel * dt.itemsize})}, kind=kind)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def weight_state(self) -> str | None:
        """The state holding the tensor's weights: master (``master`` or ``master_param``),
        else param, else the only state."""
        for s in WEIGHT_STATES:
            if s in self.states:
                return s
        return next(iter(self.states)) if len(self.states) == 1 else None

    def value_state(self) -> str:
        """The state ``consolidate`` writes for this tensor: the fp32 master where the run
        kept one (``master``: DeepSpeed; ``master_param``: ZeroMuon), else ``param``. A tensor with neither (optimizer state
        alone, as a live store keeps it) has no value to write: FormatError."""
        for s in VALUE_STATES:
            if s in self.states:
                return s
        raise FormatError(f"tensor {self.name!r} holds no weights, only "
                          f"{', '.join(self.states)}")


@dataclass
class SourceInfo:
    """The summary of an input, from metadata only."""

    kind: str                       # "store", "checkpoint", "deepspeed", "safetensors"
    path: str
    format: str                     # e.g. "offload-engine-store", "DeepSpeed ZeRO-3", "safetensors"
    format_version: object = None
    step: int | None = None
    generation: str | None = None   # checkpoint generation or DeepSpeed tag
    world_size: int | None = None
    files: list[tuple[str, int | None]] = field(default_factory=list)  # (path, bytes or None)
    file_count: int | None = None   # when files is abridged (chunk files of a store)
    notes: list[str] = field(default_factory=list)


KIND_LABELS = {
    "store": "live store",
    "checkpoint": "offload-engine checkpoint",
    "deepspeed": "DeepSpeed checkpoint",
    "safetensors": "safetensors",
}


@dataclass
class ReadRequest:
    """Fill ``out`` with elements ``[start, start + n)`` of tensor ``name``'s ``state``
    (None: its ``value_state()``), ``n`` being what ``out`` holds: a 1-D contiguous numpy
    array or CPU torch tensor of the state's dtype, or any writable buffer (bytes)."""

    name: str
    start: int
    out: object
    state: str | None = None


# visit(data, pieces): ``data`` a 1-D torch tensor of a state's dtype; ``pieces`` a list of
# (key index, lo, hi): data[lo:hi] are elements of key ``keys[key index]``.
Visit = Callable[[object, list], None]
Progress = Callable[[int, int], None]


class TensorSource:
    """What every format reader is: a reader sets ``info`` and implements ``tensors()``
    (every tensor, in the format's key order; no aliases), ``read(requests)`` (fill every
    ``ReadRequest``; errors name the file and what is wrong) and ``close()``, and
    ``aliases()`` (``{alias: owner}``) where the format ties names. It inherits look-ups by
    name, single reads, a generic ``scan`` and the context manager. (``consolidate`` needs
    only ``tensors``, ``aliases`` and ``read``: any object with those serves it.)"""

    info: SourceInfo

    def tensors(self) -> list[TensorMeta]:
        raise NotImplementedError

    def aliases(self) -> dict[str, str]:
        return {}

    def read(self, requests: Sequence[ReadRequest]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def check_readable(self, keys: Sequence[tuple[str, str]]) -> None:
        """Check, reading no data, what reads of ``keys`` ((tensor, state) pairs) rest on,
        so that a caller may size buffers or files by the tensors' shapes: after it, the
        declared sizes are ones the files on disk declare too. Errors name the file. The
        default checks nothing (formats whose metadata is the files' own sizes)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> str:
        """One line naming the input, for messages."""
        what = KIND_LABELS.get(self.info.kind, self.info.kind)
        return f"{what} {self.info.path} ({self.info.format})"

    def tensor(self, name: str) -> TensorMeta:
        """The tensor called ``name`` (an alias gives its owner); FormatError if none."""
        index = getattr(self, "_by_name", None)
        if index is None:
            index = self._by_name = {t.name: t for t in self.tensors()}
        t = index.get(name)
        if t is not None:
            return t
        owner = self.aliases().get(name)
        if owner is not None and owner in index:
            return index[owner]
        raise FormatError(f"{self.info.path}: no tensor named {name!r}")

    def read_state(self, name: str, state: str, start: int, out) -> None:
        """One read: elements ``[start, start + len(out))`` of ``name``'s ``state``."""
        self.read([ReadRequest(name, start, out, state)])

    def scan(self, keys: Sequence[tuple[str, str]], visit: Visit, progress: Progress | None = None,
             window_bytes: int = 16 * MiB, workers: int = 1) -> int:
        """Stream every element of each ``(tensor, state)`` in ``keys`` to ``visit`` (as 1-D
        torch tensors: the statistics are computed in torch, imported here); returns the
        bytes read. Generic version: tensor by tensor, the next window read on a helper
        thread while ``visit`` works on the current one (``workers`` is ignored: ``visit``
        runs on the calling thread). Readers of large contiguous arrays override it to read
        in storage order."""
        import concurrent.futures

        import torch

        from ..io import BufferPool

        metas = {t.name: t for t in self.tensors()}
        jobs = []
        for k, (name, state) in enumerate(keys):
            sm = metas[name].states[state]
            per = max(1, window_bytes // sm.dtype.itemsize)
            jobs += [(k, name, state, sm.dtype, lo, min(sm.numel, lo + per))
                     for lo in range(0, sm.numel, per)]
        total = sum((hi - lo) * dt.itemsize for _, _, _, dt, lo, hi in jobs)
        done = 0
        pool = BufferPool(2 * window_bytes + 8192)
        ex = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="oe-scan-read")
        nxt = None
        try:
            def fetch(job):
                k, name, state, dt, lo, hi = job
                buf = pool.acquire((hi - lo) * dt.itemsize)
                try:
                    data = buf.view(dt.torch, hi - lo)
                    self.read_state(name, state, lo, data)
                except BaseException:
                    buf.release()
                    raise
                return buf, data

            nxt = ex.submit(fetch, jobs[0]) if jobs else None
            for i, job in enumerate(jobs):
                buf, data = nxt.result()
                nxt = ex.submit(fetch, jobs[i + 1]) if i + 1 < len(jobs) else None
                try:
                    visit(data, [(job[0], 0, data.numel())])
                finally:
                    buf.release()
                done += data.numel() * data.element_size()
                if progress:
                    progress(done, total)
        finally:
            if nxt is not None:
                try:
                    nxt.result()[0].release()
                except BaseException:
                    pass
            ex.shutdown(wait=True)
            pool.close()
        return done
