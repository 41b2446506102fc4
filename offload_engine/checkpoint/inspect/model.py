"""What every kind of input looks like to inspection: tensors with states, and a summary.

A *logical tensor* is a parameter (or a buffer, or a flat array of a store that records no
tensors) with its global shape. Each tensor has one or more *states*: ``param`` (the
parameter's values), ``master`` (fp32 master copy), ``momentum_buffer`` (Muon),
``exp_avg`` / ``exp_avg_sq`` (Adam), or, for a bare store array, the array's own name.
A state is read as the tensor's flattened elements, reassembled from its shards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# The state that stands for the tensor's value, in order of preference ("weights");
# ``master_param`` is torch's (and ZeroMuon's) key for the fp32 master copy.
WEIGHT_STATES = ("master", "master_param", "param")


@dataclass
class StateMeta:
    """One state of one tensor: stored dtype, elements, and bytes held by each rank.

    ``bytes_by_rank`` keys are ranks (ints), or None where the input has no ranks
    (safetensors, an unsharded DeepSpeed buffer).
    """

    dtype: torch.dtype
    numel: int
    bytes_by_rank: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_by_rank.values())


@dataclass
class TensorMeta:
    """A logical tensor: ``kind`` is "param", "frozen", "buffer" or "array" (a store array
    listed without a tensor manifest; ``home`` is then its tier)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    optimizer: str | None
    states: dict[str, StateMeta]
    kind: str = "param"
    home: str | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def weight_state(self) -> str | None:
        """The state holding the tensor's value: master (``master`` or ``master_param``),
        else param, else the only state."""
        for s in WEIGHT_STATES:
            if s in self.states:
                return s
        return next(iter(self.states)) if len(self.states) == 1 else None


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
