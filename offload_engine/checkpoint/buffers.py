"""A model's persistent buffers (what ``state_dict`` holds besides parameters: BatchNorm
statistics, position ids, ...), saved by rank 0 and restored on every rank.

FSDP2 shards parameters only; buffers stay whole and equal on every rank, so one copy is
enough. Non-persistent buffers (``register_buffer(..., persistent=False)``) are rebuilt by
the model itself and are not saved, as in ``state_dict``.
"""

from __future__ import annotations

import torch


def persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{fully qualified name: buffer}`` of the buffers ``model.state_dict()`` would hold."""
    out = {}
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is None or name in module._non_persistent_buffers_set:
                continue
            fqn = f"{module_name}.{name}" if module_name else name
            out.setdefault(fqn, buf)
    return out


def snapshot_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of the persistent buffers as they are now (bytes: the buffers' own size):
    a forward pass may update them (BatchNorm) while the save runs in the background."""
    return {name: buf.detach().to("cpu", copy=True) for name, buf in persistent_buffers(model).items()}
