"""``ZeroMuon.state``: torch's ``optimizer.state`` (parameter -> {state key: tensor}) as a view.

torch.distributed.checkpoint's helpers read ``optim.state`` directly: whether it is empty
(an empty one gets a step with zero gradients to create the state) and, to unflatten a
flattened optimizer state dict, the state keys of each parameter. ZeroMuon's state lives in
its store, so this view lists every parameter that has state (has taken a step or had state
loaded) with all its keys; the values are StoreTensors (read on use, see lazy_state.py) and,
for AdamW, the step count. Nothing is held: each lookup builds the entry afresh.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping


class StateView(Mapping):
    """Read-only ``{parameter: {state key: tensor}}`` of a ZeroMuon (see the module docstring)."""

    def __init__(self, opt):
        self._opt = opt

    def _info(self, param):
        info = self._opt._info_of.get(id(param))
        if info is None or info.param is not param or info.index not in self._opt._initialized:
            return None
        return info

    def __getitem__(self, param) -> dict:
        info = self._info(param)
        if info is None:
            raise KeyError("this parameter has no optimizer state (not this optimizer's, or "
                           "before its first step)")
        from .state_io import lazy_state
        return lazy_state(self._opt, info)

    def __contains__(self, param) -> bool:
        return self._info(param) is not None

    def __iter__(self) -> Iterator:
        return (info.param for info in self._opt.infos if info.index in self._opt._initialized)

    def __len__(self) -> int:
        return len(self._opt._initialized)

    def __repr__(self) -> str:
        return f"<ZeroMuon state of {len(self)} parameters (in its store)>"
