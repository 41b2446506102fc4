"""ZeroMuon as a torchtitan optimizer: built by torchtitan's optimizer container from its
config, saved and restored by its CheckpointManager (torchtitan 0.3.0; docs/torchtitan.md).

torchtitan builds its optimizers in ``OptimizersContainer``: each ``ParamGroupConfig`` names
an optimizer, the container looks the name up (``_resolve_optimizer_factory``) and calls the
factory once per model part with the group dicts it built (``params``, their canonical names
in ``param_names``, the ``fused``/``foreach`` flags of ``implementation`` and the group's
``optimizer_kwargs``) and ``optimizer_factory_kwargs_by_name[name]``. This module adds the
name ``"ZeroMuon"`` to that lookup in a container subclass, so a torchtitan config switches
optimizer by naming the subclass's Config:

    optimizer=ZeroMuonOptimizersContainer.Config(param_groups=[ParamGroupConfig(
        pattern=r".*", optimizer_name="ZeroMuon",
        optimizer_kwargs={"lr": 0.02, "weight_decay": 0.1, "adamw": {"lr": 8e-4}})],
        optimizer_factory_kwargs_by_name={"ZeroMuon": {"store": {"nvme_paths": [dir]}}})

Checkpoints need nothing more: the container's FQN-keyed flat state dict reads ZeroMuon's
``state_dict()`` (DTensor state read from the store tensor by tensor) and loads through its
``load_state_dict``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial

from torchtitan.components.optimizer import OptimizersContainer

from ..errors import InputError
from ..optim import ZeroMuon
from ..store import StoreConfig

ZERO_MUON = "ZeroMuon"
# keys torchtitan puts in every group dict that are not ZeroMuon options: the parameter
# names (ZeroMuon takes them as (name, tensor) pairs instead) and torch's fused/foreach
# kernel choice (ZeroMuon has one implementation)
_TORCHTITAN_GROUP_KEYS = ("params", "param_names", "fused", "foreach")


def store_for_part(store, part: int, parts: int):
    """The store config of model part ``part`` of ``parts`` on this rank: with several parts
    (pipeline stages), each ZeroMuon needs a store folder of its own, ``<path>/part<i>`` under
    every ``nvme_paths`` entry (then ``rank<r>`` as always); one part keeps ``store`` as is."""
    if parts == 1 or store is None:
        return store
    if isinstance(store, dict):
        paths = [os.path.join(p, f"part{part}") for p in store.get("nvme_paths", [])]
        return {**store, "nvme_paths": paths} if "nvme_paths" in store else store
    if isinstance(store, StoreConfig):
        paths = [os.path.join(p, f"part{part}") for p in store.nvme_paths]
        return store.model_copy(update={"nvme_paths": paths})
    raise InputError(f"{parts} model parts on this rank (pipeline stages) need a store each: "
                     f"give ZeroMuon a store config (a dict or StoreConfig), not an open "
                     f"{type(store).__name__}")


def build_zero_muon(param_groups: list[dict], *, model_part: tuple[int, int] = (0, 1),
                    **zero_muon_options) -> ZeroMuon:
    """One ZeroMuon over torchtitan's group dicts for one model part.

    ``param_groups``: the dicts torchtitan's ``OptimizersContainer`` builds, one per
    ``ParamGroupConfig`` whose ``optimizer_name`` is ``"ZeroMuon"``; their
    ``optimizer_kwargs`` are ZeroMuon's constructor keywords (``lr``, ``weight_decay``,
    ``momentum``, ``adamw={...}``, ...) and must be the same in every group: ZeroMuon
    itself splits the parameters between Muon (hidden matrices) and AdamW by name.
    ``zero_muon_options``: ``optimizer_factory_kwargs_by_name["ZeroMuon"]``, the instance-wide
    keywords (``store``, ``master_weights``, ``stale_store``, ``expert_params``).
    ``model_part``: (index, count) of the model part on this rank (``store_for_part``).
    """
    named, options = [], None
    for group in param_groups:
        group_options = {k: v for k, v in group.items() if k not in _TORCHTITAN_GROUP_KEYS}
        if options is not None and group_options != options:
            raise InputError(
                f"torchtitan ParamGroupConfig entries for {ZERO_MUON} have different "
                f"optimizer_kwargs ({options} and {group_options}): ZeroMuon takes one set "
                "and splits parameters between Muon and AdamW itself; give every ZeroMuon "
                "entry the same optimizer_kwargs (AdamW's in adamw={...})")
        options = group_options
        names = group.get("param_names")
        if names is None or len(names) != len(group["params"]):
            raise InputError(f"a torchtitan parameter group for {ZERO_MUON} has no "
                             "param_names matching its params (torchtitan 0.3.0 adds them)")
        named.extend(zip(names, group["params"]))
    clash = set(options or {}) & set(zero_muon_options)
    if clash:
        raise InputError(f"{sorted(clash)} given both in a ParamGroupConfig's optimizer_kwargs "
                         f"and in optimizer_factory_kwargs_by_name[{ZERO_MUON!r}]")
    if "store" in zero_muon_options:
        zero_muon_options["store"] = store_for_part(zero_muon_options["store"], *model_part)
    return ZeroMuon(named, **(options or {}), **zero_muon_options)


class ZeroMuonOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` that also knows ``optimizer_name="ZeroMuon"``.

    Everything else is the parent's: mixed optimizers per pattern, the flat FQN-keyed state
    dict its CheckpointManager saves, the step pre-hooks. ``close()`` closes every ZeroMuon
    (flushing and releasing its store); call it when training ends.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass

    def __init__(self, config: Config, *, model_parts: list) -> None:
        # the parent asks for a factory once per model part, in order: count them so that
        # each part's ZeroMuon gets a store folder of its own
        self._zero_muon_parts = (0, len(model_parts))
        super().__init__(config, model_parts=model_parts)

    def _resolve_optimizer_factory(self, name: str):
        if name != ZERO_MUON:
            return OptimizersContainer._resolve_optimizer_factory(name)
        part, parts = self._zero_muon_parts
        self._zero_muon_parts = (part + 1, parts)
        return partial(build_zero_muon, model_part=(part, parts))

    def close(self) -> None:
        """Close every ZeroMuon this container holds (see ``ZeroMuon.close``)."""
        for optimizer in self.optimizers:
            if isinstance(optimizer, ZeroMuon):
                optimizer.close()
