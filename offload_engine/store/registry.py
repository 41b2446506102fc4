"""The store's arrays: their names, home tiers and buckets, and the store group's manifest.

``register`` cuts an array into buckets (store/geometry.py), picks its home tier, and for
an NVMe-home array opens or creates its zarr array (striped over the NVMe paths) and
records it in the manifest before it counts as registered. The manifest also carries
entries of the layers above (the optimizer's tables); they are kept across rewrites and
reopenings. The registry takes no lock: the store calls it under its own.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from .. import dtypes
from ..errors import InputError, UsageError
from ..layout import FlatArray
from ..layout.store_group import STORE_KEYS, open_store_group, store_array_entry, write_store_group
from ..layout.member_paths import name_problem
from ..layout.striping import stripe_chunks
from . import geometry
from .bucket import Bucket
from .config import StoreConfig
from .earlier_run import EarlierRun, find_earlier_run, remove_earlier_arrays

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")


@dataclass(eq=False)
class StoreArray:
    """A registered flat array: ``numel`` elements of ``dtype`` in buckets of
    ``bucket_elems`` elements (the last one shorter), kept on tier ``home``; ``flat`` is its
    zarr array on disk (NVMe home only)."""

    name: str
    dtype: torch.dtype
    numel: int
    itemsize: int
    home: str
    bucket_elems: int
    buckets: list
    flat: FlatArray | None = None


def check_new_array(name: str, dtype: torch.dtype, numel: int) -> None:
    """Refuse (InputError) a name, size or dtype no store array can have."""
    if not _NAME.match(name):
        raise InputError(f"array name {name!r}: use letters, digits, '_', '.', '-' and '/'")
    # the rule every reader of the manifest applies (layout/member_paths.py): a name the
    # readers refuse would be written, then never read or cleaned (`stale_store="discard"`)
    problem = name_problem(name)
    if problem is not None:
        raise InputError(f"array name {name!r} {problem}: array names are paths inside the "
                         f"store directory")
    if numel < 0:
        raise InputError(f"array {name}: numel must be >= 0, got {numel}")
    dtypes.zarr_dtype(dtypes.dtype(dtype).name)  # raises for a dtype no array can hold


class ArrayRegistry:
    """The arrays of one store and its manifest.

    Args:
        config: the store's config (bucket size, homes, prefetch depth for ``auto``).
        root: the store group's directory (the first NVMe path), or None without NVMe.
        stripes: every NVMe directory, absolute; bucket ``i`` lives on ``stripes[i % n]``.
        io: the AsyncFileIO the arrays' chunk files are read and written with.
        gpu_capacity: bytes of the GPU tier, or None without one.
        pool_capacity: bytes of the pinned pool.
    """

    def __init__(self, config: StoreConfig, root: str | None, stripes: list[str], io,
                 gpu_capacity: int | None, pool_capacity: int):
        self._config = config
        self._root = root
        self._stripes = stripes
        self._io = io
        self._capacity = {"gpu": gpu_capacity, "cpu": pool_capacity}
        self._auto_bytes = {"gpu": 0, "cpu": 0}
        # name -> StoreArray; changed in place only (the store reads buckets through it)
        self.arrays: dict[str, StoreArray] = {}
        # entries of the layers above (the optimizer's tables), kept from an earlier run
        self.manifest_extra: dict = open_store_group(root) if root is not None else {}

    def add(self, name: str, dtype: torch.dtype, numel: int, home: str | None) -> StoreArray:
        """Register an array checked by ``check_new_array``: its buckets, its home, and
        for NVMe its zarr array and manifest entry. Returns its description."""
        if name in self.arrays:
            raise InputError(f"array {name} is already registered")
        itemsize = geometry.itemsize_of(dtype)
        bucket_bytes = self._config.bucket_bytes
        home = self._choose_home(name, home, numel * itemsize)
        arr = StoreArray(name, dtype, numel, itemsize, home,
                         geometry.elems_per_bucket(bucket_bytes, itemsize), [])
        for i, (start, stop) in enumerate(geometry.bucket_spans(numel, itemsize, bucket_bytes)):
            arr.buckets.append(Bucket(arr, i, start, stop, (stop - start) * itemsize,
                                      pinned_home=home in ("cpu", "gpu")))
        if home == "nvme":
            arr.flat = self._open_or_create(arr)
            # the manifest first: an array it does not list is not registered, so a
            # failed write (a full disk) can be retried by registering again
            self._write_manifest({**self.arrays, name: arr}, self.manifest_extra)
        self.arrays[name] = arr
        return arr

    def _choose_home(self, name: str, home: str | None, nbytes: int) -> str:
        home = home or self._config.home_of(name)
        gpu_capacity = self._capacity["gpu"]
        if home == "auto":
            # fill the GPU, then the pinned pool (keeping room for the NVMe working set), then NVMe
            reserve = (self._config.prefetch_depth + 2) * self._config.bucket_bytes
            if gpu_capacity is not None and self._auto_bytes["gpu"] + nbytes <= gpu_capacity:
                home = "gpu"
            elif (self._auto_bytes["cpu"] + nbytes + reserve <= self._capacity["cpu"]
                  or not self._root):
                home = "cpu"
            else:
                home = "nvme"
            if home in self._auto_bytes:
                self._auto_bytes[home] += nbytes
        if home == "gpu" and gpu_capacity is None:
            raise InputError(f"array {name}: home tier 'gpu' needs CUDA and a gpu_budget > 0"
                             + ("" if torch.cuda.is_available() else " (CUDA is not available)"))
        if home == "nvme" and self._root is None:
            raise InputError(f"array {name}: home tier 'nvme' needs nvme_paths in the config")
        if home not in ("gpu", "cpu", "nvme"):
            raise InputError(f"array {name}: unknown home tier {home!r}")
        return home

    def _open_or_create(self, arr: StoreArray) -> FlatArray:
        path = os.path.join(self._root, arr.name)
        reopened = os.path.exists(os.path.join(path, "zarr.json"))
        if reopened:
            flat = FlatArray.open(path, io=self._io, mode="r+")
            if (flat.dtype != arr.dtype or flat.numel != arr.numel
                    or (flat.chunk_elems != arr.bucket_elems and len(arr.buckets) > 1)):
                raise InputError(
                    f"array {arr.name} in {path} has dtype {flat.dtype}, {flat.numel} elements and "
                    f"{flat.chunk_elems}-element chunks; asked for {arr.dtype}, {arr.numel} and "
                    f"{arr.bucket_elems}")
        else:
            flat = FlatArray.create(path, arr.numel, arr.dtype, io=self._io,
                                    chunk_bytes=self._config.bucket_bytes,
                                    attributes={"offload_engine": {"home": "nvme"}},
                                    dimension_name=FlatArray.dimension_for(arr.name))
        stripe_chunks(flat, arr.name, self._stripes)
        # asked once here (an array just made has no chunk files); from now on the store is
        # the array's only writer, so reads and writes trust this record, and the chunks
        # they create, instead of asking the file system at every access
        present = ({i for i in range(flat.nchunks) if os.path.exists(flat.chunk_path(i))}
                   if reopened else set())
        flat.track_chunks(present)
        ce = flat.chunk_elems
        for b in arr.buckets:
            b.on_disk = any(c in present for c in range(b.start // ce, -(-b.stop // ce)))
        return flat

    def _write_manifest(self, arrays: dict, extra: dict) -> None:
        """Rewrite the store group's manifest for ``arrays`` (name -> StoreArray) and the
        entries ``extra`` of the layers above; the caller records them once this returned."""
        entries = {a.name: store_array_entry(dtypes.dtype(a.dtype).name, a.numel, a.home,
                                             a.bucket_elems)
                   for a in arrays.values() if a.home == "nvme"}
        write_store_group(self._root, entries, self._stripes, extra)

    # -- what an earlier run left; the layers' manifest entries -----------------------------
    def earlier_run(self, names=()) -> EarlierRun | None:
        """See ``TieredStore.earlier_run``."""
        return None if self._root is None else find_earlier_run(self._root, names)

    def discard_earlier_run(self, earlier: EarlierRun) -> None:
        """See ``TieredStore.discard_earlier_run``."""
        if self.arrays:
            raise UsageError("discard_earlier_run: arrays are registered already")
        remove_earlier_arrays(earlier, self._stripes)
        self._write_manifest({}, {})
        self.manifest_extra = {}

    def update_manifest(self, entries: dict) -> None:
        """See ``TieredStore.update_manifest``."""
        reserved = STORE_KEYS & set(entries)
        if reserved:
            raise InputError(f"manifest keys {sorted(reserved)} belong to the store")
        extra = {**self.manifest_extra, **entries}
        if self._root is not None:
            self._write_manifest(self.arrays, extra)
        self.manifest_extra = extra  # only once written: a failed write changes nothing

    # -- lookups ---------------------------------------------------------------------------
    def get(self, name: str) -> StoreArray:
        """The array ``name``; KeyError naming it when none is registered."""
        try:
            return self.arrays[name]
        except KeyError:
            raise KeyError(f"no array named {name!r} is registered in this store") from None

    def locate(self, name: str, rng) -> tuple[Bucket, int, int]:
        """The bucket holding ``rng`` of ``name`` (a bucket index, or a ``(start, stop)``
        element range inside one bucket) and the range's first and stop element."""
        arr = self.get(name)
        if isinstance(rng, int):
            if not 0 <= rng < len(arr.buckets):
                raise IndexError(f"array {name} has {len(arr.buckets)} buckets; no bucket {rng}")
            b = arr.buckets[rng]
            return b, b.start, b.stop
        start, stop = rng
        if not 0 <= start <= stop <= arr.numel:
            raise IndexError(f"range [{start}, {stop}) is outside array {name} of {arr.numel} elements")
        if not arr.buckets:
            raise IndexError(f"array {name} is empty")
        b = arr.buckets[min(start // arr.bucket_elems, len(arr.buckets) - 1)]
        if stop > b.stop:
            raise InputError(f"range [{start}, {stop}) of {name} crosses a bucket boundary at "
                             f"element {b.stop}; acquire each bucket of bucket_ranges() separately")
        return b, start, stop

    def check_keys(self, keys) -> None:
        """Refuse (IndexError) any ``(array, bucket_index)`` of ``keys`` that names no bucket."""
        for name, idx in keys:
            n = len(self.get(name).buckets)
            if not 0 <= idx < n:
                raise IndexError(f"schedule names bucket {idx} of {name}, which has {n}")
