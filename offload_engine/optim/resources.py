"""What a ZeroMuon step works with, made once at construction: the step's explicit inputs.

The step pipeline (``pipeline.py``) takes a ``StepResources`` instead of the optimizer, so
what a stage may touch is written down here: the store, the state layout, the parameters'
shapes, each Muon bundle's exchange plan and the buffers sized once for the largest of
everything. Nothing in it changes from step to step (that is ``pipeline.StepContext``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .comm import ExchangePlan, Exchange
from .muon_math import NewtonSchulz
from .params import ParamInfo
from .state_layout import Layout


class Scratch:
    """Preallocated 1-D buffers, one per (use, dtype), of ``max_numel`` elements each (the
    longest segment of a bucket row): the step's temporaries without an allocation."""

    def __init__(self, max_numel: int, device: torch.device):
        self.max_numel = max(max_numel, 1)
        self.device = device
        self._buffers: dict = {}

    def get(self, use: str, dtype: torch.dtype, n: int) -> torch.Tensor:
        """The first ``n`` elements of the buffer for ``use`` ("u", "grad", "denom") in ``dtype``."""
        buf = self._buffers.get((use, dtype))
        if buf is None:
            buf = self._buffers[(use, dtype)] = torch.empty(self.max_numel, dtype=dtype,
                                                            device=self.device)
        return buf[:n]

    def buffers(self) -> list[torch.Tensor]:
        """The buffers allocated so far (each made on first use), in the order made."""
        return list(self._buffers.values())

    @property
    def nbytes(self) -> int:
        """Bytes allocated so far."""
        return sum(b.numel() * b.element_size() for b in self.buffers())


@dataclass
class StepResources:
    """Everything a step reads or writes besides the parameters and gradients."""

    store: object                          # the TieredStore holding this rank's state
    layout: Layout
    infos: list[ParamInfo]
    plans: dict[int, ExchangePlan]         # Muon bundle index -> its all_to_all buffer layout
    exchange: Exchange                     # the send/receive buffers and byte counters
    ns: NewtonSchulz                       # the Newton-Schulz workspace
    scratch: Scratch
    device: torch.device
    prefix: str = ""                       # of this rank's array names in the store
    owner: dict[int, int] = field(default_factory=dict)  # 2-D Muon param -> rank that runs its NS
    # (param, expert) -> rank that runs its NS, every matrix of an exchanged bundle (a 2-D
    # parameter is expert 0)
    matrix_owner: dict[tuple[int, int], int] = field(default_factory=dict)

    def array_name(self, name: str) -> str:
        """The store's name of layout array ``name``."""
        return self.prefix + name
