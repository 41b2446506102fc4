"""DeepSpeed settings that belong to the training loop, as the torch lines that do the same.

DeepSpeed's engine clips gradients and steps its LR scheduler inside ``engine.step()``;
with FSDP2 + ZeroMuon the loop does both. ``loop_code`` gives, for the keys of a DeepSpeed
config that ask for them, the lines to paste into the loop (``opt`` is the ZeroMuon
instance, ``model`` the FSDP2 model), so "ignored: keep it in your loop" comes with what to
write. Values are the config's own (checked by ``deepspeed_keys`` before the rules read
them).

WarmupLR (DeepSpeed ``deepspeed/runtime/lr_schedules.py``): ``warmup_min_lr`` (default 0)
to ``warmup_max_lr`` (default 0.001) over ``warmup_num_steps`` (default 1000), ``log``
(default) or ``linear``, then constant. WarmupDecayLR: the same warm-up, then linear decay
to 0 at ``total_num_steps``. Both become a ``LambdaLR`` whose factor multiplies the
optimizer's lr, which the translation sets to ``warmup_max_lr``.
"""

from __future__ import annotations

import math

WARMUP_DEFAULTS = {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000,
                   "warmup_type": "log"}


def clipping_line(value) -> str | None:
    """The line for ``gradient_clipping`` (0 or absent: none)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        return None
    return f"torch.nn.utils.clip_grad_norm_(model.parameters(), {value!r})  # before opt.step()"


def warmup_factor(step: int, params: dict, total_steps: int | None = None) -> float:
    """The lr of DeepSpeed's WarmupLR (or WarmupDecayLR with ``total_steps``) once
    ``LambdaLR`` has stepped ``step`` times, as a factor of ``warmup_max_lr``: the function
    the pasted lambda computes. DeepSpeed's scheduler applies its iteration 0 twice (at
    construction and after the first step), so ``step`` s is its iteration ``max(s - 1, 0)``;
    the lrs equal DeepSpeed 0.19.8's, step for step (tested against a recording)."""
    step = max(step - 1, 0)
    p = {**WARMUP_DEFAULTS, **params}
    lo, hi, n = float(p["warmup_min_lr"]), float(p["warmup_max_lr"]), int(p["warmup_num_steps"])
    if step < n:
        frac = math.log(step + 1) / math.log(n) if p["warmup_type"] == "log" and n > 1 else \
            min(1.0, step / max(1, n))
        lr = lo + (hi - lo) * frac
    elif total_steps is None:
        lr = hi
    else:
        lr = hi * max(0.0, (total_steps - step) / max(1.0, total_steps - n))
    return lr / hi if hi else 0.0


def scheduler_lines(scheduler: dict) -> list[str] | None:
    """Lines that build DeepSpeed's WarmupLR / WarmupDecayLR on ZeroMuon (None for another
    scheduler type: the generic advice applies)."""
    kind = scheduler.get("type")
    params = scheduler.get("params") if isinstance(scheduler.get("params"), dict) else {}
    if kind not in ("WarmupLR", "WarmupDecayLR"):
        return None
    p = {**WARMUP_DEFAULTS, **{k: v for k, v in params.items() if k in WARMUP_DEFAULTS}}
    args = (f"warmup_min_lr={p['warmup_min_lr']!r}, warmup_max_lr={p['warmup_max_lr']!r}, "
            f"warmup_num_steps={p['warmup_num_steps']!r}, warmup_type={p['warmup_type']!r}")
    total = params.get("total_num_steps") if kind == "WarmupDecayLR" else None
    return [
        "from offload_engine.plan.deepspeed_loop import warmup_factor",
        f"sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_factor(s, dict({args})"
        + (f", total_steps={total!r}" if total is not None else "") + "))",
        "sched.step()  # after each opt.step(); build ZeroMuon with lr = warmup_max_lr",
    ]


def loop_code(ds: dict) -> dict[str, list[str]]:
    """``{DeepSpeed key: lines of torch}`` for the loop settings of config ``ds``."""
    out: dict[str, list[str]] = {}
    line = clipping_line(ds.get("gradient_clipping"))
    if line:
        out["gradient_clipping"] = [line]
    if isinstance(ds.get("scheduler"), dict):
        lines = scheduler_lines(ds["scheduler"])
        if lines:
            out["scheduler"] = lines
    return out
