"""Which optimizers a checkpoint can save and load: ZeroMuon, whose state lives in its
tiered store. Anything else is refused with a TypeError that says so, instead of an
AttributeError from deep inside the save."""

from __future__ import annotations


def check_optimizer(optimizer, what: str, allow_none: bool = False):
    """``optimizer`` if it is a ZeroMuon (or None where ``allow_none``); TypeError naming
    its type and what is supported otherwise."""
    from ..optim.zero_muon import ZeroMuon
    if optimizer is None and allow_none:
        return None
    if isinstance(optimizer, ZeroMuon):
        return optimizer
    got = "None" if optimizer is None else f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    raise TypeError(
        f"{what}: the optimizer must be an offload_engine.optim.ZeroMuon (its state lives in "
        f"its tiered store), got {got}. For another optimizer use torch.distributed.checkpoint; "
        "to load only weights pass optimizer=None to load_checkpoint")
