"""Our own format: live store directories and checkpoint generations (docs/format.md)."""

from .generations import locate, resolve
from .reader import OursSource

__all__ = ["OursSource", "locate", "resolve"]
