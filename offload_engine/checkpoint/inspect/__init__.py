"""Offline inspection of live stores, offload-engine checkpoints, DeepSpeed ZeRO
checkpoints and safetensors: listing from metadata, streamed statistics, diff, export.

Needs no GPU, no training code and no deepspeed. ``open_source(path)`` detects the kind
and returns an ``InspectSource``.
"""

from __future__ import annotations

from .detect import detect, detect_with_manifest
from ..checksums import ChecksumError
from .errors import InspectError
from .model import KIND_LABELS, SourceInfo, StateMeta, TensorMeta
from .source import InspectSource


def open_source(path: str, generation: str | None = None, **zarr_options) -> InspectSource:
    """Open ``path`` as whatever kind it is (``detect``); ``generation`` picks a checkpoint
    generation or a DeepSpeed tag instead of the one ``latest`` names. ``zarr_options``
    (``window_bytes``, ``depth``) tune store and checkpoint reads."""
    kind, target, gen, attrs = detect_with_manifest(path, generation)
    if kind in ("store", "checkpoint"):
        from .zarr_source import ZarrSource
        return ZarrSource(target, kind, generation=gen, attrs=attrs, **zarr_options)
    if kind == "deepspeed":
        from .deepspeed_source import DeepSpeedInspectSource
        return DeepSpeedInspectSource(target, tag=gen)
    from .safetensors_source import SafetensorsSource
    return SafetensorsSource(target)


__all__ = ["ChecksumError", "InspectError", "InspectSource", "KIND_LABELS", "SourceInfo",
           "StateMeta", "TensorMeta", "detect", "open_source"]
