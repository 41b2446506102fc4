"""state_dict() and load_state_dict(): the store's flat arrays <-> torch's per-parameter state.

The tensors of a state dict are StoreTensors (lazy_state.py): they read the store when used,
so torch.distributed.checkpoint saves and loads one parameter's state at a time. Everything
here goes through the optimizer's state object (``opt.optimizer_state``, an
``optimizer_state.OptimizerState``) and its public methods.

The state dict has torch's shape: ``{"state": {index: {...}}, "param_groups": [...]}``
with parameters numbered over the groups in order. Muon entries hold ``momentum_buffer``
(torch's lerp convention, so ``torch.optim.Muon`` continues from it); AdamW entries hold
``step``, ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq``); with master weights, also
``master_param``. For a DTensor parameter each tensor is a DTensor with the parameter's
mesh and placements (this rank's box: its rows under FSDP2, as FSDP2 optimizers do); for
a plain parameter a plain tensor. Loading accepts either, or a full tensor (cut to this
rank's box), so a state dict saved at one world size or mesh loads at another through
full tensors.
"""

from __future__ import annotations

import torch

from .sharding import is_dtensor
from ..errors import InputError

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None


def _wrap(info, local: torch.Tensor) -> torch.Tensor:
    p = info.param
    if not is_dtensor(p):
        return local
    with torch.no_grad():
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())


def lazy_state(state, info) -> dict:
    """``{torch state key: StoreTensor}`` of one parameter (DTensor-wrapped for a DTensor
    parameter) of ``state`` (an OptimizerState), plus ``step`` (a copy) for AdamW. Reads
    nothing."""
    entry = {}
    if info.kind == "adamw":
        entry["step"] = state.step_tensor(info)
    for key in state.layout.bundle_of(info.index).keys:
        entry[key.kind.state_key] = _wrap(info, state.lazy_tensor(info, key))
    return entry


def _in_store(state, info, akey, value) -> bool:
    """Whether ``value`` is ``state``'s current StoreTensor of this very array (DCP loaded
    into it: the store holds its values already)."""
    return state.owns(value._local_tensor if is_dtensor(value) else value, info, akey)


def read_state(opt) -> dict:
    state = opt.optimizer_state
    out = {info.index: lazy_state(state, info) for info in state.initialized_infos()}
    groups, start = [], 0
    for g in opt.param_groups:
        packed = {k: v for k, v in g.items() if k != "params"}
        packed["params"] = list(range(start, start + len(g["params"])))
        start += len(g["params"])
        groups.append(packed)
    return {"state": out, "param_groups": groups}


def _local_part(state, info, value: torch.Tensor, key: str) -> torch.Tensor:
    """This rank's box of ``value`` as a flat tensor in the state's dtype."""
    want = state.local_shape(info)
    if is_dtensor(value):
        loc = value.to_local()
        if is_dtensor(info.param) and tuple(value.placements) == tuple(info.param.placements) \
                and value.device_mesh == info.param.device_mesh \
                and tuple(loc.shape) == want and tuple(value.shape) == info.shape:
            value = loc
        else:
            value = value.full_tensor()
    if tuple(value.shape) == info.shape and info.distributed:
        value = value[info.box(state.rank).slices()]
    if tuple(value.shape) != want:
        raise InputError(f"state {key!r} of parameter {info.name or info.index} has shape "
                         f"{tuple(value.shape)}; expected the full {info.shape} or this rank's {want}")
    return value.reshape(-1)


def load_state(opt, state_dict: dict) -> None:
    groups = state_dict["param_groups"]
    if len(groups) != len(opt.param_groups):
        raise InputError(f"loaded state dict has {len(groups)} parameter groups; this optimizer "
                         f"has {len(opt.param_groups)}")
    for i, (saved, mine) in enumerate(zip(groups, opt.param_groups)):
        if len(saved["params"]) != len(mine["params"]):
            raise InputError(f"parameter group {i}: loaded state dict has {len(saved['params'])} "
                             f"parameters, this optimizer {len(mine['params'])}")
        if "use_muon" in saved and bool(saved["use_muon"]) != mine["use_muon"]:
            raise InputError(f"parameter group {i}: use_muon is {saved['use_muon']} in the state "
                             f"dict and {mine['use_muon']} here")
    saved_ids = [pid for g in groups for pid in g["params"]]
    states = state_dict["state"]
    state = opt.optimizer_state
    state.flush()  # what DCP loaded into the last buffer it was given
    with torch.no_grad():
        for info, pid in zip(opt.infos, saved_ids):
            entry = states.get(pid)
            keys = state.layout.bundle_of(info.index).keys
            if entry is None:
                for akey in keys:
                    state.write(info, akey, None)
                state.forget(info)
                continue
            for akey in keys:
                key = akey.kind.state_key
                if key in entry and _in_store(state, info, akey, entry[key]):
                    continue  # already in the store
                if key not in entry:
                    if key != "master_param":
                        raise KeyError(f"state of parameter {info.name or info.index} has no {key!r}")
                    value = _local_part(state, info, info.param.detach(), key)  # master from the param
                else:
                    value = _local_part(state, info, entry[key], key)
                state.write(info, akey, value.to(dtype=akey.dtype.torch, device=state.device))
            if info.kind == "adamw":
                if "step" not in entry:
                    raise KeyError(f"state of parameter {info.name or info.index} has no 'step'")
                state.set_step_count(info, float(entry["step"]))
            state.mark_initialized([info.index])
        for saved, mine in zip(groups, opt.param_groups):
            for k, v in saved.items():
                if k not in ("params", "param_names", "use_muon"):
                    mine[k] = v


def split_state_dict(state_dict: dict) -> tuple[dict, dict]:
    """Split a ZeroMuon state dict into (Muon, AdamW) state dicts that
    ``torch.optim.Muon`` and ``torch.optim.AdamW`` load for the same parameters (Muon
    groups in order, then AdamW groups in order; ``master_param`` is dropped). DTensor
    state stays DTensor: call ``full_tensor()`` on it to load into unsharded optimizers."""
    out = {flag: {"state": {}, "param_groups": []} for flag in (True, False)}
    next_id = {True: 0, False: 0}
    for g in state_dict["param_groups"]:
        flag = bool(g.get("use_muon"))
        ids = []
        for pid in g["params"]:
            nid = next_id[flag]
            next_id[flag] += 1
            if pid in state_dict["state"]:
                out[flag]["state"][nid] = {k: v for k, v in state_dict["state"][pid].items()
                                           if k != "master_param"}
            ids.append(nid)
        packed = {k: v for k, v in g.items() if k not in ("params", "use_muon")}
        packed["params"] = ids
        out[flag]["param_groups"].append(packed)
    return out[True], out[False]
