"""Parameter groups: which optimizer each group uses, and its hyperparameters.

A group has ``use_muon`` True (torch.optim.Muon's hyperparameters) or False
(torch.optim.AdamW's). Groups without ``use_muon`` are split by a rule
(``default_use_muon`` unless told otherwise); names come from ``(name, param)`` pairs as
``model.named_parameters()`` yields them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Callable

import torch

from .muon_defaults import ADJUST_LR_FNS, DEFAULT_EPS, DEFAULT_NS_COEFFICIENTS, DEFAULT_NS_STEPS
from .param_rules import default_use_muon
from ..errors import InputError

# torch.optim.Muon(lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True, ...) in 2.13
MUON_DEFAULTS = {
    "lr": 1e-3, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True,
    "ns_coefficients": DEFAULT_NS_COEFFICIENTS, "eps": DEFAULT_EPS, "ns_steps": DEFAULT_NS_STEPS,
    "adjust_lr_fn": None,
}
# torch.optim.AdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, ...)
ADAMW_DEFAULTS = {
    "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, "amsgrad": False,
    "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
    "fused": None, "decoupled_weight_decay": True,
}
# AdamW options that select another implementation; only torch's CPU default path is offered
_ADAMW_FIXED = {"foreach": (None, False), "capturable": (False,), "differentiable": (False,),
                "fused": (None, False), "decoupled_weight_decay": (True,)}


def split_groups(params, rule: Callable = default_use_muon) -> list[dict]:
    """Normalize ``params`` (tensors, (name, tensor) pairs, or group dicts) into groups that
    each carry ``use_muon``; a group without it becomes up to two groups by ``rule``."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors, (name, tensor) pairs or dicts; "
                        "got a single Tensor")
    items = list(params)
    if not items:
        raise InputError("optimizer got an empty parameter list")
    groups = items if isinstance(items[0], dict) else [{"params": items}]
    out = []
    for g in groups:
        if not isinstance(g, dict):
            raise TypeError("mixing group dicts with plain parameters is not supported")
        plist = g["params"]
        plist = [plist] if isinstance(plist, torch.Tensor) else list(plist)
        opts = {k: v for k, v in g.items() if k != "params"}
        if "use_muon" in g:
            out.append({"params": plist, **opts, "use_muon": bool(g["use_muon"])})
            continue
        muon, adamw = [], []
        for item in plist:
            name, p = item if isinstance(item, tuple) else (None, item)
            (muon if rule(name, p) else adamw).append(item)
        for chosen, flag in ((muon, True), (adamw, False)):
            if chosen:
                out.append({"params": chosen, **opts, "use_muon": flag})
    return out


def fill_defaults(group: dict, muon_defaults: dict, adamw_defaults: dict) -> dict:
    """Fill and check one group's hyperparameters (torch's checks and messages). Other keys
    are kept, as torch keeps them (schedulers add their own)."""
    if group["use_muon"]:
        for k, v in muon_defaults.items():
            group.setdefault(k, v)
        _check_muon(group)
    else:
        for k, v in adamw_defaults.items():
            group.setdefault(k, v)
        _check_adamw(group)
    return group


def _check_muon(g: dict) -> None:
    lr = g["lr"]
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise InputError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise InputError(f"Learning rate should be >= 0 but is: {lr}")
    if not 0.0 <= g["momentum"]:
        raise InputError(f"momentum should be >= 0 but is: {g['momentum']}")
    if not 0.0 <= g["weight_decay"]:
        raise InputError(f"weight decay should be >= 0 but is: {g['weight_decay']}")
    if g["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise InputError(f"Adjust learning rate function {g['adjust_lr_fn']} is not supported")
    if g["ns_steps"] >= 100:
        raise InputError("Number of steps must be less than 100 for computational efficiency")
    if len(g["ns_coefficients"]) != 3:
        raise InputError("Coefficients must be a tuple of exactly 3 values")


def _check_adamw(g: dict) -> None:
    lr, eps, (b1, b2), wd = g["lr"], g["eps"], g["betas"], g["weight_decay"]
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise InputError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise InputError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise InputError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= b1 < 1.0:
        raise InputError(f"Invalid beta parameter at index 0: {b1}")
    if not 0.0 <= b2 < 1.0:
        raise InputError(f"Invalid beta parameter at index 1: {b2}")
    if not 0.0 <= wd:
        raise InputError(f"Invalid weight_decay value: {wd}")
    for k, allowed in _ADAMW_FIXED.items():
        if g.get(k) not in allowed:
            raise InputError(f"AdamW option {k}={g.get(k)!r} is not supported by ZeroMuon "
                             f"(it follows torch's default CPU path: {k}={allowed[0]!r})")


def scalar(x) -> float:
    """A float from a float or a 1-element tensor (torch's ``_to_scalar``)."""
    return x.item() if isinstance(x, torch.Tensor) else x


def iter_named(group: dict) -> Iterable[tuple[str | None, torch.Tensor]]:
    names = group.get("param_names") or [None] * len(group["params"])
    return zip(names, group["params"])
