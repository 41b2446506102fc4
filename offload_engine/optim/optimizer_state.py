"""ZeroMuon's state, as one object the optimizer owns: what is in the store and what is not.

Everything the optimizer knows about its state lives here, behind public methods that the
state-dict code (``state_io.py``), the checkpoint layer's access (``state_access.py``), the
lazy tensors (``lazy_state.py``) and torch's ``optimizer.state`` view (``state_view.py``)
use; none of them reaches into the optimizer:

- the store handle and where each parameter's state is in it (the layout), read and written
  one parameter and array at a time (``read``, ``write``);
- the lazy tensors handed out (``lazy_tensor``) and the one buffer a lazy tensor may have
  out: before an array changes, the tensors still alive for it read their values first;
- which parameters have state (``initialized``: they took a step or had state loaded);
- the AdamW step counts, the only state kept outside the store (torch's ``step`` tensors).

A parameter is named by its ``ParamInfo``, an array by its ``ArrayKey``; values are this
rank's part of the state (its box of the parameter), flat in the store.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..errors import UsageError
from .lazy_state import LazyViews, StoreTensor


def _scalar_dtype() -> torch.dtype:
    """The dtype of a new AdamW step count: torch.optim.AdamW's (float64 when it is the default)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class OptimizerState:
    """One rank's optimizer state: the store's arrays, the lazy tensors handed out, the
    parameters with state and the AdamW step counts (see the module docstring).

    Args:
        store: the open TieredStore holding this rank's state arrays.
        layout: the state layout (``state_layout.Layout``): which bucket holds what.
        infos: every parameter's ParamInfo, by index.
        rank: this rank in the optimizer's exchange group (picks the box of a distributed
            parameter this rank holds).
        device: where the step works (the parameters' device).
        array_name: layout array name -> the store's name.
    """

    def __init__(self, store, layout, infos, rank: int, device: torch.device, array_name):
        self.store = store
        self.layout = layout
        self.infos = infos
        self.rank = rank
        self.device = device
        self.array_name = array_name
        self._by_param = {id(i.param): i for i in infos}
        self._initialized: set[int] = set()
        self._steps: dict[int, torch.Tensor] = {}   # AdamW parameter index -> step count
        self._views = LazyViews(self)

    # -- parameters --------------------------------------------------------------------------
    def info_of(self, param) -> object | None:
        """The ParamInfo of ``param`` (this very tensor), or None if it is not ours."""
        info = self._by_param.get(id(param))
        return info if info is not None and info.param is param else None

    def local_shape(self, info) -> tuple[int, ...]:
        """The shape of this rank's part of ``info``'s state (its box; a plain tensor: all)."""
        return info.local_shape(self.rank if info.distributed else 0)

    # -- which parameters have state -----------------------------------------------------------
    def initialized(self, info) -> bool:
        """Whether ``info`` has state: it took a step or had state loaded."""
        return info.index in self._initialized

    def initialized_infos(self) -> list:
        """The parameters with state, in index order."""
        return [i for i in self.infos if i.index in self._initialized]

    def uninitialized(self, indices: Iterable[int]) -> set[int]:
        """Those of parameter ``indices`` without state yet (a step starts their masters
        from the parameters)."""
        return set(indices) - self._initialized

    def mark_initialized(self, indices: Iterable[int]) -> None:
        """Parameters ``indices`` have state now (every array of theirs was written)."""
        self._initialized.update(indices)

    def forget(self, info) -> None:
        """``info`` has no state any more (its arrays hold zeros): no step count either."""
        self._initialized.discard(info.index)
        self._steps.pop(info.index, None)

    # -- AdamW step counts -------------------------------------------------------------------
    def step_count(self, info) -> float | None:
        """The AdamW step count of ``info`` (None before its first step, or for Muon)."""
        step = self._steps.get(info.index)
        return None if step is None else float(step)

    def step_tensor(self, info) -> torch.Tensor:
        """A copy of ``info``'s AdamW step count as torch keeps it (a 0-d tensor)."""
        return self._steps[info.index].clone()

    def set_step_count(self, info, step: float) -> None:
        """Set ``info``'s AdamW step count (loaded state: an fp32 tensor, as torch's)."""
        self._steps[info.index] = torch.tensor(float(step), dtype=torch.float32)

    def advance_step(self, info) -> float:
        """Count one more AdamW step of ``info`` (its first starts from 0, as torch's
        AdamW does) and return the new count."""
        step = self._steps.get(info.index)
        if step is None:
            step = self._steps[info.index] = torch.tensor(0.0, dtype=_scalar_dtype())
        step += 1
        return float(step)

    # -- the store's values ------------------------------------------------------------------
    def read(self, info, key, device: torch.device | None = None) -> torch.Tensor:
        """This rank's part of state array ``key`` (an ArrayKey) of ``info``, in its local
        shape, on ``device`` (the optimizer's if None), as the store holds it. A host read of
        a host- or NVMe-home array comes straight from the store's pinned buffer: no round
        trip through GPU memory."""
        if self.store is None:
            raise UsageError(f"state {key.kind.state_key!r} of parameter "
                             f"{info.name or info.index}: the optimizer was closed")
        device = torch.device(self.device if device is None else device)
        name = self.array_name(key.name)
        # a GPU-home array is lent on the GPU only; its values come over afterwards
        lend = self.device if self.store.arrays()[name].home == "gpu" else device
        bundle = self.layout.bundle_of(info.index)
        out = torch.zeros(bundle.sizes[info.index], dtype=key.dtype.torch, device=device)
        for j, seg in self.layout.param_pieces(info.index):
            h = self.store.acquire(name, bundle.rows[j].buckets[key.name], device=lend)
            try:
                out[seg.lo:seg.hi].copy_(h.tensor[seg.offset:seg.offset + seg.hi - seg.lo])
            finally:
                self.store.release(h)
        return out.view(self.local_shape(info))

    def write(self, info, key, value: torch.Tensor | None, keep=None) -> None:
        """Write this rank's part (flat, of ``bundle.sizes`` elements, in ``key.dtype`` on
        the optimizer's device) of state array ``key`` of ``info``, or zeros (None), into
        the store. Lazy tensors handed out for that array (but ``keep``'s, a lazy source
        whose values these are) read their old values first."""
        self._views.before_write(info.index, key.name, keep=keep)
        bundle = self.layout.bundle_of(info.index)
        for j, seg in self.layout.param_pieces(info.index):
            h = self.store.acquire(self.array_name(key.name), bundle.rows[j].buckets[key.name],
                                   device=self.device)
            try:
                dst = h.tensor[seg.offset:seg.offset + seg.hi - seg.lo]
                if value is None:
                    dst.zero_()
                else:
                    dst.copy_(value[seg.lo:seg.hi])
            finally:
                self.store.release(h, dirty=True)

    # -- lazy tensors ------------------------------------------------------------------------
    def lazy_tensor(self, info, key) -> StoreTensor:
        """A tensor of ``info``'s state ``key`` on this rank that reads the store on use
        (lazy_state.py); reads nothing now."""
        return StoreTensor(self._views.source(info, key, self.local_shape(info)))

    def owns(self, tensor, info, key) -> bool:
        """Whether ``tensor`` is a current lazy tensor of this very state array (whoever
        loaded into it changed the store already)."""
        if not isinstance(tensor, StoreTensor):
            return False
        src = tensor.source_of(self._views)
        return src is not None and src.info.index == info.index and src.akey.name == key.name

    def flush(self) -> None:
        """Write what was loaded into a lazy tensor's buffer (dcp.load) back to the store."""
        self._views.flush()

    def before_write(self) -> None:
        """Before every array may change (a step, ``close``): the buffer out goes back and
        every live lazy tensor reads its values into memory, so state dicts taken earlier
        keep theirs."""
        self._views.before_write()

    def detach_store(self) -> None:
        """The store was closed: reading state from now on is an error that says so."""
        self.store = None
