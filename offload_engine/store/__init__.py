"""The tiered store: flat state arrays across GPU, pinned CPU and NVMe (docs/store.md).

Importing the package imports only its configuration schema (pydantic): the planner reads
``StoreConfig`` and must not pay for torch. Every other name is imported on first use.
"""

from .config import StoreConfig

__all__ = ["BucketIOError", "Handle", "LockFileError", "SlowDiskError", "StoreConfig",
           "StoreLockedError", "StoreStats", "TieredStore"]

# name -> the module that defines it, imported when the name is first asked for
_LAZY = {
    "Handle": "bucket",
    "TieredStore": "tiered_store",
    "StoreLockedError": "lock",
    "LockFileError": "lock",
    "BucketIOError": "errors",
    "SlowDiskError": "errors",
    "StoreStats": "counters",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
