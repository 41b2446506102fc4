"""checkpoint/: save and load ZeroMuon training runs (reshardable, checksummed, atomically
committed generations).

Reading a generation back goes through the one reader of our format
(``formats.ours.OursSource``); the offline tools (consolidate, inspect, diff, export) are
``offline/``. ``save_checkpoint``, ``save_checkpoint_async`` and ``load_checkpoint`` are
imported on first use: they pull in torch.distributed.
"""

from ..formats.errors import CheckpointError, CheckpointSaveError
from ..formats.ours.checkpoint_listing import GenerationRemovedError, resolve
from ..layout.checksums import ChecksumError

__all__ = ["CheckpointError", "CheckpointLockedError", "CheckpointSaveError", "ChecksumError",
           "GenerationRemovedError", "load_checkpoint", "resolve", "save_checkpoint",
           "save_checkpoint_async"]


def __getattr__(name: str):
    if name in ("save_checkpoint", "save_checkpoint_async"):
        from . import save
        return getattr(save, name)
    if name == "CheckpointLockedError":
        from .writer_lock import CheckpointLockedError
        return CheckpointLockedError
    if name == "load_checkpoint":
        from .load import load_checkpoint
        return load_checkpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
