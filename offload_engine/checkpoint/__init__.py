"""checkpoint/: save and load ZeroMuon runs (reshardable, checksummed, atomically committed),
read DeepSpeed checkpoints, and consolidate either into Hugging Face safetensors.

``save_checkpoint``, ``save_checkpoint_async`` and ``load_checkpoint`` are imported on first use: they pull in
torch.distributed, which offline tools (inspect, consolidate, plan) never need.
"""

from .checksums import ChecksumError
from .generations import CheckpointError, resolve

__all__ = ["CheckpointError", "ChecksumError", "load_checkpoint", "resolve", "save_checkpoint",
           "save_checkpoint_async"]


def __getattr__(name: str):
    if name in ("save_checkpoint", "save_checkpoint_async"):
        from . import save
        return getattr(save, name)
    if name == "load_checkpoint":
        from .load import load_checkpoint
        return load_checkpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
