"""DeepSpeed ZeRO-1/2/3 checkpoints, read without importing deepspeed or running a pickle."""

from .files import DeepSpeedLayoutError
from .partitions import PartitionError
from .reader import DeepSpeedSource

__all__ = ["DeepSpeedLayoutError", "DeepSpeedSource", "PartitionError"]
