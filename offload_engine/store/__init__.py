"""The tiered store: flat state arrays across GPU, pinned CPU and NVMe (docs/store.md)."""

from .config import StoreConfig
from .lock import StoreLockedError
from .stats import StoreStats
from .tiered_store import Handle, TieredStore

__all__ = ["Handle", "StoreConfig", "StoreLockedError", "StoreStats", "TieredStore"]
