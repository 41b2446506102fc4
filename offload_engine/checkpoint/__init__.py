"""checkpoint/: save and load ZeroMuon runs (reshardable, checksummed, atomically committed),
read DeepSpeed checkpoints, and consolidate either into Hugging Face safetensors."""

from .checksums import ChecksumError
from .generations import CheckpointError, resolve
from .load import load_checkpoint
from .save import save_checkpoint

__all__ = ["CheckpointError", "ChecksumError", "load_checkpoint", "resolve", "save_checkpoint"]
