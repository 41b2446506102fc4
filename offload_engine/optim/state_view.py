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

from .state_io import lazy_state


class StateView(Mapping):
    """Read-only ``{parameter: {state key: tensor}}`` of a ZeroMuon's state (an
    ``optimizer_state.OptimizerState``; see the module docstring)."""

    def __init__(self, state):
        self._state = state

    def _info(self, param):
        info = self._state.info_of(param)
        return info if info is not None and self._state.initialized(info) else None

    def __getitem__(self, param) -> dict:
        info = self._info(param)
        if info is None:
            raise KeyError("this parameter has no optimizer state (not this optimizer's, or "
                           "before its first step)")
        return lazy_state(self._state, info)

    def __contains__(self, param) -> bool:
        return self._info(param) is not None

    def __iter__(self) -> Iterator:
        return (info.param for info in self._state.initialized_infos())

    def __len__(self) -> int:
        return len(self._state.initialized_infos())

    def __repr__(self) -> str:
        return f"<ZeroMuon state of {len(self)} parameters (in its store)>"
