"""DeepSpeed ZeRO-1/2/3 checkpoints, read without importing deepspeed."""

from .files import DeepSpeedLayoutError
from .layout import LayoutError
from .source import DeepSpeedSource

__all__ = ["DeepSpeedLayoutError", "DeepSpeedSource", "LayoutError"]
