"""formats/: one reader per checkpoint format, one interface, one detector.

Every reader is a ``TensorSource`` (``source.py``): ours (live stores and checkpoint
generations, ``ours/``), DeepSpeed ZeRO-1/2/3 (``deepspeed/``) and safetensors
(``safetensors.py``, which also holds the one safetensors header codec). ``open_source``
detects what a path is (``detect.py``) and opens it. Nothing here imports torch or
ml_dtypes: bytes are read by range into the caller's buffers.
"""

from __future__ import annotations

from .detect import detect, detect_with_manifest
from .errors import CheckpointError, FormatError
from .source import (KIND_LABELS, ReadRequest, SourceInfo, StateMeta, TensorMeta,
                     TensorSource)


def open_source(path: str, generation: str | None = None, **options) -> TensorSource:
    """Open ``path`` as whatever kind it is (``detect``); ``generation`` picks a checkpoint
    generation or a DeepSpeed tag instead of the one ``latest`` names. ``options``
    (``window_bytes``, ``depth``) tune reads of our stores and checkpoints."""
    kind, target, gen, attrs = detect_with_manifest(path, generation)
    if kind in ("store", "checkpoint"):
        from .ours import OursSource
        return OursSource(target, kind, generation=gen, attrs=attrs, **options)
    if kind == "deepspeed":
        from .deepspeed import DeepSpeedSource
        return DeepSpeedSource(target, tag=gen)
    from .safetensors import SafetensorsSource
    return SafetensorsSource(target)


__all__ = ["CheckpointError", "FormatError", "KIND_LABELS", "ReadRequest", "SourceInfo",
           "StateMeta", "TensorMeta", "TensorSource", "detect", "open_source"]
