"""Our own format: live store directories and checkpoint generations (docs/format.md)."""

from .checkpoint_listing import find_generation, list_committed_generations, resolve
from .reader import OursSource

__all__ = ["OursSource", "find_generation", "list_committed_generations", "resolve"]
