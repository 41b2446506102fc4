"""Optimizer state tensors that stay in the store until used.

``ZeroMuon.state_dict()`` and ``ZeroMuon.state`` hand out ``StoreTensor``s: tensors with the
shape and dtype of one parameter's state on this rank (this rank's rows) that hold no bytes.
Any operation on one reads that state from the store first (``torch.equal``, ``.clone()``,
``full_tensor()`` of the DTensor around it, ``torch.save``) and drops the bytes afterwards,
so whoever walks a state dict of them one tensor at a time (torch.distributed.checkpoint)
holds one parameter's state at a time, never the whole state.

DCP's planners ask each for its values through ``__get_tensor_shard__`` (the _Checkpointable
protocol, which DTensor forwards to its local tensor); the answer is a StoreTensor on the
host, still lazy, because DCP's FileSystemWriter keeps every tensor it wrote until the
rank's file is closed (and copies a device tensor to the host first): ``torch.save`` of it
reads the values into host memory (``__reduce_ex__``), and what DCP keeps holds no bytes.
Slices and aliases of it stay lazy, so ``dcp.load`` can narrow one to a
chunk and ``copy_`` into it: an in-place operation on a current StoreTensor changes the
optimizer's state, as on torch's own state tensors. It goes into a buffer with the array's
values; one buffer per optimizer is out at a time: changing another array writes the
previous buffer back to the store and drops it; ``load_state_dict``, ``step`` and ``close``
write back the last one.

They are snapshots, as the copies the eager state dict used to hold: before the optimizer
changes a state array (a step, ``load_state_dict``, ``load_checkpoint``, ``close``), every
StoreTensor still alive for that array reads its values into memory first, so a state dict
taken earlier keeps the values it was taken with.
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch.utils._pytree import tree_map


class Source:
    """One state array of one parameter on this rank: where a StoreTensor's values are.

    ``views`` is the LazyViews that handed it out (its ``state``, an
    ``optimizer_state.OptimizerState``, reads and writes the store). ``data`` is None while
    the values are in the store; a tensor once they were read into memory (the optimizer was
    about to change them, or the tensor was changed in place)."""

    __slots__ = ("views", "info", "akey", "shape", "data", "__weakref__")

    def __init__(self, views, info, akey, shape):
        self.views, self.info, self.akey, self.shape, self.data = views, info, akey, shape, None

    def read(self, device: torch.device | None = None) -> torch.Tensor:
        """The current values (this rank's part, in the parameter's local shape), on
        ``device`` (the optimizer's if None)."""
        views = self.views
        if self.data is not None:
            values = self.data
        elif views.pending is not None and views.pending[0] is self:
            values = views.pending[1]
        else:
            return views.state.read(self.info, self.akey, device)
        return values if device is None else values.to(device)

    def materialize(self) -> None:
        if self.data is None:
            self.data = self.read().clone()


class LazyViews:
    """The StoreTensors handed out for one optimizer's ``state`` (weakly) and the one
    buffer out. ``state`` reads and writes the store: ``read(info, akey, device)``,
    ``write(info, akey, flat, keep=source)`` and ``device`` (an OptimizerState)."""

    def __init__(self, state):
        self.state = state
        # by (parameter index, array name): a write looks at its own array's only
        self.sources = WeakLists()
        self.pending: list | None = None  # [Source, buffer, changed]

    def source(self, info, akey, shape) -> Source:
        # a change made through the buffer out is the state a new StoreTensor must show
        self.flush()
        src = Source(self, info, akey, tuple(shape))
        self.sources.add((info.index, akey.name), src)
        return src

    def checkout(self, src: Source) -> torch.Tensor:
        """A buffer with ``src``'s current values for an in-place change; written back to
        the store when the next one is checked out or at ``flush``."""
        if src.data is not None:
            return src.data
        if self.pending is None or self.pending[0] is not src:
            self.flush()
            self.pending = [src, src.read(), False]
        # an in-place op run inside __torch_dispatch__ does not move the buffer's version
        # counter (that happens above the Python key): the caller is about to change it
        self.pending[2] = True
        return self.pending[1]

    def flush(self) -> None:
        """Write the buffer out back to the store (what DCP loaded into it)."""
        if self.pending is None:
            return
        src, buf, changed = self.pending
        self.pending = None
        if changed and src.data is None:
            with torch.no_grad():
                self.state.write(src.info, src.akey,
                                 buf.reshape(-1).to(dtype=src.akey.dtype.torch,
                                                    device=self.state.device),
                                 keep=src)

    def before_write(self, index: int | None = None, name: str | None = None,
                     keep: Source | None = None) -> None:
        """Before the store's state array ``name`` of parameter ``index`` changes (every
        array: None, None): the buffer out goes back and every live StoreTensor of it except
        ``keep`` reads its values into memory."""
        self.flush()

        def live():
            pool = self.sources.live(None if index is None else (index, name))
            return [src for src in pool if src is not keep and src.data is None]

        if index is None and live():
            gc.collect()  # a state dict in a reference cycle is garbage, not a snapshot to keep
        for src in live():
            src.materialize()


class WeakLists:
    """Objects by key, held weakly, with no callback: a dead one is dropped when met (when
    listed, or in a sweep once the lists have doubled since the last), never by the
    collector. A ``WeakSet`` runs Python code wherever one of its objects dies, and a
    signal's handler that runs inside it has its KeyboardInterrupt or SystemExit printed as
    "ignored" and lost: a training loop went on after Ctrl-C (the signal trials)."""

    def __init__(self):
        self._refs: dict = {}   # key -> [weakref.ref]
        self._count = 0
        self._sweep_at = 64

    def add(self, key, obj) -> None:
        self._refs.setdefault(key, []).append(weakref.ref(obj))
        self._count += 1
        if self._count >= self._sweep_at:
            for k in list(self._refs):
                self._live(k)
            self._count = sum(len(refs) for refs in self._refs.values())
            self._sweep_at = max(64, 2 * self._count)

    def live(self, key=None) -> list:
        """The live objects of ``key`` (every key: None)."""
        keys = list(self._refs) if key is None else [key]
        return [obj for k in keys for obj in self._live(k)]

    def _live(self, key) -> list:
        refs = self._refs.get(key)
        if not refs:
            return []
        objs = [obj for obj in (r() for r in refs) if obj is not None]
        if len(objs) < len(refs):
            if objs:
                self._refs[key] = [weakref.ref(obj) for obj in objs]
            else:
                del self._refs[key]
        return objs


def _narrowed(t: torch.Tensor, region) -> torch.Tensor:
    for dim, start, length in region:
        t = t.narrow(dim, start, length)
    return t


def _values(x):
    return _narrowed(x._src.read(x.device), x._region) if isinstance(x, StoreTensor) else x


_aten = torch.ops.aten
_ALIASES = {_aten.detach.default, _aten.alias.default}
_VIEWS = {_aten.view.default, _aten._unsafe_view.default}


def _slice_bounds(size: int, start, end, step) -> tuple[int, int] | None:
    """(start, length) of ``t[start:end]`` along a dimension of ``size``; None for a step."""
    if step not in (None, 1):
        return None
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else (end + size if end < 0 else end)
    start, end = min(max(start, 0), size), min(max(end, 0), size)
    return start, max(end - start, 0)


class StoreTensor(torch.Tensor):
    """A tensor whose values are one parameter's state in the optimizer's store (this rank's
    part, or a slice of it), read on use. See the module docstring."""

    @staticmethod
    def __new__(cls, src: Source, region: tuple = (), device: torch.device | None = None):
        shape = list(src.shape)
        for dim, _, length in region:
            shape[dim] = length
        r = torch.Tensor._make_wrapper_subclass(
            cls, tuple(shape), dtype=src.akey.dtype.torch,
            device=src.views.state.device if device is None else device, requires_grad=False)
        r._src, r._region = src, tuple(region)
        return r

    def __init__(self, src: Source, region: tuple = (), device: torch.device | None = None):
        super().__init__()

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, StoreTensor):
            src, region = first._src, first._region
            if func in _ALIASES or (func in _VIEWS and tuple(args[1]) == tuple(first.shape)):
                return StoreTensor(src, region, first.device)  # still lazy
            if func is _aten.slice.Tensor:
                dim = (args[1] if len(args) > 1 else 0) % first.dim()
                bounds = _slice_bounds(first.shape[dim], *(list(args[2:5]) + [None] * 3)[:3])
                if bounds is not None:
                    return StoreTensor(src, region + ((dim,) + bounds,), first.device)
            if func is _aten.is_pinned.default:
                return False  # a pinned store buffer is the store's, never handed out
            if func._schema.is_mutable:
                # in place (dcp.load's copy_): into the optimizer's state, through the buffer
                target = _narrowed(src.views.checkout(src), region)
                func(target, *tree_map(_values, args[1:]), **tree_map(_values, kwargs))
                return first
        return func(*tree_map(_values, args), **tree_map(_values, kwargs))

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        """torch.distributed.checkpoint: this rank's values, still lazy (see the module), on
        the host. DCP's writer copies a CUDA tensor to host memory when it reaches it and
        keeps the copy until the rank's file is written (the whole state, on CUDA); a host
        StoreTensor is written as it is: ``torch.save`` reads its values from the store
        straight into host memory, one tensor at a time. A load copies into it as into the
        optimizer's own state (through the buffer on the optimizer's device)."""
        return self if self.device.type == "cpu" else \
            StoreTensor(self._src, self._region, torch.device("cpu"))

    def numpy(self, *, force: bool = False):
        return _values(self).numpy(force=force)

    def tolist(self):
        return _values(self).tolist()

    def __deepcopy__(self, memo):
        return _values(self).clone()

    def __reduce_ex__(self, protocol):
        return _values(self).clone().__reduce_ex__(protocol)

    def __repr__(self):
        return f"StoreTensor({_values(self)!r})"

    def source_of(self, views: LazyViews) -> Source | None:
        """The Source if ``views`` handed it out and these are the store's current values
        (not a snapshot read into memory), else None."""
        src = self._src
        return src if src.views is views and src.data is None else None
