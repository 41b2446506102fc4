"""The type and range of every DeepSpeed config key ``config from-deepspeed`` computes from.

A DeepSpeed config is untrusted input (docs/untrusted-input.md): before any rule of
``deepspeed_config.py`` reads a value, ``check_keys`` checks it against ``KEY_TYPES`` (the
types DeepSpeed 0.19.8's own pydantic models give these keys) and refuses a value of
another type or out of range with one line naming the file and the dotted key:
"ds.json: optimizer.params.lr: expected a finite number >= 0, got 'abc'". A value that
was silently clamped (a negative block size), passed through (a string learning rate) or
crashed the translation (a list where a count goes) is refused here instead.

``"auto"`` is accepted for every key (the Hugging Face Trainer fills it in at run time;
the translation reports it as ignored). Integers may be written as integral floats
(``"sub_group_size": 1e9``, as DeepSpeed's documentation writes them).
"""

from __future__ import annotations

import json
import math

from ..errors import InputError

MAX_INT = (1 << 63) - 1  # sizes and counts are int64 in DeepSpeed and in the store
MAX_COUNT = (1 << 31) - 1  # buffer counts, queue depths, threads: C ints in DeepSpeed's aio

# Parts of a DeepSpeed config that are objects of keys: any other value there (a number, a
# list, a string) is a config the rules cannot read.
SECTIONS = ("zero_optimization", "zero_optimization.offload_optimizer",
            "zero_optimization.offload_param", "aio", "optimizer", "optimizer.params",
            "bf16", "fp16", "scheduler")


def _size(value):
    """A positive integer (bytes or elements); integral floats such as 1e9 count."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if type(value) is not int or not 1 <= value <= MAX_INT:
        raise ValueError("a positive integer")
    return value


def _count(value):
    value = _size(value) if not isinstance(value, bool) else value
    if type(value) is not int or value > MAX_COUNT:
        raise ValueError(f"a positive integer of at most {MAX_COUNT}")
    return value


def _stage(value):
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if type(value) is not int or not 0 <= value <= 3:
        raise ValueError("a ZeRO stage 0, 1, 2 or 3")
    return value


def _number(low: float, high: float | None = None, high_open: bool = False):
    def check(value):
        if type(value) not in (int, float) or not math.isfinite(value) or value < low or (
                high is not None and (value >= high if high_open else value > high)):
            what = f">= {low}" if high is None else f"in [{low}, {high}{')' if high_open else ']'}"
            raise ValueError(f"a finite number {what}")
        return value
    return check


def _bool(value):
    if type(value) is not bool:
        raise ValueError("true or false")
    return value


def _text(value):
    if not isinstance(value, str):
        raise ValueError("a string")
    return value


def _path(value):
    if value is not None and not isinstance(value, str):
        raise ValueError("a path (a string) or null")
    if isinstance(value, str) and "\0" in value:
        raise ValueError("a path without NUL characters")
    return value


def _device(value):
    if value not in ("none", "cpu", "nvme"):
        raise ValueError("one of 'none', 'cpu', 'nvme'")
    return value


def _betas(value):
    fraction = _number(0, 1, high_open=True)
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError("a list of two numbers in [0, 1)")
    try:
        return [fraction(v) for v in value]
    except ValueError:
        raise ValueError("a list of two numbers in [0, 1)") from None


OFFLOAD = "zero_optimization.offload_optimizer."
PARAMS = "optimizer.params."
KEY_TYPES = {
    "zero_optimization.stage": _stage,
    "zero_optimization.sub_group_size": _size,
    "zero_optimization.save_muon_momentum_buffer_in_memory": _bool,
    OFFLOAD + "device": _device,
    OFFLOAD + "nvme_path": _path,
    OFFLOAD + "buffer_count": _count,
    OFFLOAD + "pin_memory": _bool,
    OFFLOAD + "pipeline_read": _bool,
    OFFLOAD + "pipeline_write": _bool,
    OFFLOAD + "fast_init": _bool,
    OFFLOAD + "ratio": _number(0, 1),
    "aio.block_size": _size,
    "aio.queue_depth": _count,
    "aio.intra_op_parallelism": _count,
    "aio.thread_count": _count,
    "aio.single_submit": _bool,
    "aio.overlap_events": _bool,
    "aio.use_gds": _bool,
    "optimizer.type": _text,
    PARAMS + "lr": _number(0),
    PARAMS + "adam_lr": _number(0),
    PARAMS + "muon_lr": _number(0),
    PARAMS + "momentum": _number(0, 1, high_open=True),
    PARAMS + "betas": _betas,
    PARAMS + "eps": _number(0),
    PARAMS + "weight_decay": _number(0),
    PARAMS + "amsgrad": _bool,
    PARAMS + "adam_w_mode": _bool,
    PARAMS + "bias_correction": _bool,
    "bf16.enabled": _bool,
    "fp16.enabled": _bool,
}


def check_keys(tree: dict, keys: dict[str, object], source: str) -> dict[str, object]:
    """``keys`` (the config's dotted leaves) with every key of ``KEY_TYPES`` checked and
    normalised (``1e9`` -> ``1000000000``); raises ``InputError`` naming ``source``, the key,
    what was expected and what was found. ``tree`` is the parsed config (its sections must
    be objects)."""
    for section in SECTIONS:
        node = tree
        for part in section.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None and not isinstance(node, dict):
            raise InputError(f"{source}: {section}: expected an object of keys, got "
                             f"{show(node)}")
    out = dict(keys)
    for key, check in KEY_TYPES.items():
        if key not in keys or keys[key] == "auto":
            continue
        try:
            out[key] = check(keys[key])
        except ValueError as e:
            raise InputError(f"{source}: {key}: expected {e}, got {show(keys[key])}") from None
    return out


def show(value) -> str:
    """``value`` as JSON, at most 60 characters: what a one-line error quotes."""
    text = json.dumps(value, allow_nan=False, default=str)
    return text if len(text) <= 60 else text[:57] + "..."
