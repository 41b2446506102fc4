"""The store's configuration schema: validated, unknown keys rejected by name.

Sizes take ints or strings such as "8GiB" / "5GB". A config loads from a dict or a JSON file:
``StoreConfig.model_validate(d)`` / ``StoreConfig.from_file(path)``.
"""

from __future__ import annotations

import fnmatch
from typing import Annotated, Literal

from pydantic import BaseModel, ValidationError, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from ..units import PAGE, GiB, MiB, parse_bytes
from ..errors import InputError
from ..jsonlimits import read_json_file

Tier = Literal["gpu", "cpu", "nvme"]
Bytes = Annotated[int, BeforeValidator(parse_bytes), Field(ge=0)]
# Bytes of a store config file read (``from_file``): real ones are well under 1 KB.
MAX_CONFIG_BYTES = 1 * MiB


class StoreConfig(BaseModel):
    """Where optimizer state lives and how it moves. All sizes are bytes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nvme_paths: list[str] = Field(default_factory=list, description=(
        "Directories on NVMe; the first holds the zarr group, buckets are striped over all "
        "of them round-robin."))
    cpu_budget: Bytes = Field(GiB, description="Pinned host pool, bytes (one arena).")
    gpu_budget: Bytes = Field(0, description="GPU memory for state, bytes (CUDA only).")
    bucket_bytes: Bytes = Field(64 * MiB, description=(
        "Bytes per bucket (unit of residency and of one chunk file); multiple of 4096."))
    io_threads: int = Field(8, ge=1, le=256, description=(
        "I/O worker threads; when not set: the larger queue depth of the two directions."))
    queue_depth: int = Field(8, ge=1, le=1024, description=(
        "I/O pieces in flight per direction; when not set: the device profile's choice "
        "(docs/store.md, I/O settings), else this default."))
    block_size: Bytes = Field(8 * MiB, description=(
        "Bytes per I/O piece; multiple of 4096; when not set: the device profile's choice."))
    io_streams: int = Field(1, ge=1, le=64, description=(
        "Requests served at once per direction, one piece from each in turn (several "
        "regions of the disk busy at once); when not set: the device profile's choice."))
    read_mode: Literal["auto", "direct", "buffered"] = Field("auto", description=(
        "How buckets are read: O_DIRECT, buffered with readahead hints, or 'auto' (the "
        "device profile's choice)."))
    write_mode: Literal["auto", "direct", "buffered"] = Field("auto", description=(
        "How buckets are written: O_DIRECT, buffered with write-out and DONTNEED, or 'auto'."))
    adaptive_io: bool = Field(True, description=(
        "Step mode, queue depth, block size and streams within the profile's measured points when "
        "the achieved GB/s of a direction drops (fields set in this config stay fixed)."))
    prefetch_depth: int = Field(2, ge=0, le=1024, description="Buckets read ahead of use.")
    alternate_order: bool = Field(True, description=(
        "Walk the backward order every other step (see set_schedule) so buckets still "
        "cached are used first."))
    default_home: Literal["auto", "gpu", "cpu", "nvme"] = Field("nvme", description=(
        "Home tier of arrays not named in `homes`; 'auto' fills gpu, then cpu, then nvme."))
    homes: dict[str, Tier] = Field(default_factory=dict, description=(
        "Home tier per array name, or per fnmatch pattern ('rank*/muon_momentum')."))
    acquire_timeout_s: float = Field(60.0, gt=0, description=(
        "Longest wait for pinned space held by acquire() without release() (no I/O in "
        "flight that would free it) before acquire() fails with PoolExhaustedError."))
    io_timeout_s: float = Field(600.0, gt=0, description=(
        "Longest wait of one acquire for I/O in flight (its bucket's read, or reads and "
        "write-backs that free pinned space) before it fails with SlowDiskError."))

    @field_validator("bucket_bytes", "block_size")
    @classmethod
    def _multiple_of_page(cls, v: int, info) -> int:
        if v <= 0 or v % PAGE:
            raise InputError(f"{info.field_name} must be a positive multiple of {PAGE} bytes, got {v}")
        return v

    @model_validator(mode="after")
    def _nvme_needed(self) -> "StoreConfig":
        uses_nvme = self.default_home in ("nvme", "auto") or "nvme" in self.homes.values()
        if uses_nvme and not self.nvme_paths and self.default_home == "nvme":
            raise InputError("default_home is 'nvme' but nvme_paths is empty")
        if "nvme" in self.homes.values() and not self.nvme_paths:
            raise InputError("an array's home is 'nvme' but nvme_paths is empty")
        return self

    def home_of(self, name: str) -> str:
        """The home tier of array ``name``: its entry in ``homes``, else the first pattern
        there that matches it (fnmatch, in the order written), else ``default_home``."""
        if name in self.homes:
            return self.homes[name]
        for pattern, tier in self.homes.items():
            if fnmatch.fnmatchcase(name, pattern):
                return tier
        return self.default_home

    @classmethod
    def load(cls, data: dict, source: str = "store config") -> "StoreConfig":
        """Validate ``data``; errors are one line per problem, naming the key and ``source``."""
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise InputError(f"{source}: " + "; ".join(_describe(err) for err in e.errors())) from None

    @classmethod
    def from_file(cls, path: str) -> "StoreConfig":
        """Load and validate a JSON config file: strict JSON of at most ``MAX_CONFIG_BYTES``
        from a regular file (``jsonlimits``: no NaN, no deep nesting); errors name the file."""
        data = read_json_file(path, MAX_CONFIG_BYTES, what="store config")
        return cls.load(data, source=path)


def _describe(err: dict) -> str:
    key = ".".join(str(p) for p in err["loc"]) or "config"
    if err["type"] == "extra_forbidden":
        return f"unknown key '{key}'"
    return f"{key}: {err['msg'].removeprefix('Value error, ')}"


def default(key: str):
    """The default of config key ``key``: the one place the planner and the command line
    take the store's defaults from (bucket size, I/O threads, queue depth, ...)."""
    return StoreConfig.model_fields[key].default
