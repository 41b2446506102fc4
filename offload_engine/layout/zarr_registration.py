"""Teach zarr-python our ``"bfloat16"`` data type when zarr is imported, not before.

Registering it means importing zarr (0.4 s) and ml_dtypes (about 1 s on a slow machine),
which a command that reads our arrays through its own chunk I/O never needs. zarr-python
3.1 collects ``zarr.data_type`` entry points but never loads them, so registration must
come from us: at ``import offload_engine.layout``, at once if zarr is already imported,
else right after the first ``import zarr`` (a one-shot import hook), so that
``zarr.open_array`` on our bfloat16 arrays works in either order.
"""

from __future__ import annotations

import importlib.abc
import sys


def register_when_zarr_is_imported() -> None:
    """Register bfloat16 with zarr-python now, or as soon as zarr is imported."""
    if "zarr" in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterZarrImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterZarrImport())


def _register() -> None:
    from .zarr_bfloat16 import register_bfloat16

    register_bfloat16()


class _AfterZarrImport(importlib.abc.MetaPathFinder):
    """Finds zarr with the other finders, and registers once zarr's package has run."""

    def find_spec(self, name, path, target=None):
        if name != "zarr":
            return None
        sys.meta_path.remove(self)  # one shot, and no recursion below
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_package = loader.exec_module

        def exec_module(module):
            run_package(module)
            _register()

        loader.exec_module = exec_module
        return spec
