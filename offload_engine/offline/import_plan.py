"""What an imported DeepSpeed checkpoint holds, tensor by tensor (pure: no torch, no I/O).

ZeroMuon keeps, per parameter (docs/format.md, "Manifest"): ``param`` in the model's dtype,
``master_param`` (fp32) where that dtype is not fp32, and either Muon's ``momentum_buffer``
or AdamW's ``exp_avg`` / ``exp_avg_sq`` with its step count. DeepSpeed keeps fp32
``master`` partitions and its optimizer's state; this module maps one onto the other and
decides, per parameter, whether it resumes under Muon or AdamW:

- where the checkpoint records it (DeepSpeed's Muon: the ``use_muon`` flag of the
  parameter's group; a run with Adam(W) for every parameter: AdamW), that choice is kept,
  so that the state the run built up is the state that resumes it;
- else ZeroMuon's default rule (``optim.param_rules.use_muon_for``);
- every parameter where the recorded choice and the default rule differ is reported: the
  user builds ZeroMuon with the checkpoint's choice (``migrate.use_muon_rule``) or accepts
  that those parameters start their new optimizer's state from zero.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..dtypes import DType, FLOAT32, dtype as as_dtype
from ..formats.errors import FormatError
from ..formats.source import TensorMeta
from ..optim.param_rules import use_muon_for

ADAM_STATES = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True, slots=True)
class StatePlan:
    """Our state ``key`` is DeepSpeed's state ``source`` of the same tensor, stored there
    as ``stored`` and written as ``dtype`` (a cast only where ``param`` narrows the fp32
    master to the model's dtype)."""

    key: str
    source: str
    dtype: DType
    stored: DType


@dataclass(slots=True)
class TensorPlan:
    """One tensor of the imported generation."""

    name: str
    shape: tuple[int, ...]
    dtype: DType                      # the model's dtype of this tensor (the table's dtype)
    kind: str                         # "param", "frozen", "buffer"
    optimizer: str | None             # "muon", "adamw", or None (frozen, buffer, no state)
    states: tuple[StatePlan, ...] = ()  # shared by the tensors that have the same (_states)
    adam_step: float | None = None
    recorded: bool | None = None      # DeepSpeed's use of Muon for it (None: not recorded)
    default: bool | None = None       # ZeroMuon's default rule


@dataclass(slots=True)
class Disagreement:
    """A parameter whose recorded optimizer is not the one ZeroMuon's default rule picks."""

    name: str
    deepspeed: str
    default: str

    def line(self) -> str:
        return (f"{self.name}: {self.deepspeed} in the DeepSpeed run, {self.default} under "
                f"ZeroMuon's default rule; imported as {self.deepspeed}")


def _label(muon: bool) -> str:
    return "muon" if muon else "adamw"


@functools.lru_cache(maxsize=None)
def _state(key: str, source: str, dtype: DType, stored: DType) -> StatePlan:
    """One StatePlan per (key, source, dtype, stored), shared by every tensor (frozen:
    100,000 experts then hold a few, not 300,000)."""
    return StatePlan(key, source, dtype, stored)


@functools.lru_cache(maxsize=None)
def _states(states: tuple[StatePlan, ...]) -> tuple[StatePlan, ...]:
    """One tuple per distinct list of states, shared by every tensor that has it."""
    return states


def recorded_use_muon(meta: TensorMeta, optimizer: str | None) -> bool | None:
    """Whether the DeepSpeed run updated ``meta`` with Muon, where the checkpoint says."""
    if "use_muon" in meta.extra:
        return bool(meta.extra["use_muon"])
    if optimizer in ("adam", "adamw") and "exp_avg" in meta.states:
        return False  # an Adam(W) run: every parameter with moments was Adam's
    return None


def plan_tensors(tensors: list[TensorMeta], optimizer: str | None, param_dtype: DType | None,
                 where: str) -> tuple[list[TensorPlan], list[Disagreement], list[str]]:
    """The tensors to write, the disagreements, and notes for the user.

    Args:
        tensors: the DeepSpeed source's tensors (``DeepSpeedSource.tensors()``).
        optimizer: the source's optimizer kind ("adam", "adamw" or None).
        param_dtype: the model's parameter dtype; None: each master's own (fp32).
        where: the checkpoint path, for errors.

    Raises FormatError (naming ``where``) for a recorded choice ZeroMuon cannot resume.
    """
    plans, disagreements, notes = [], [], []
    for meta in tensors:
        if meta.kind in ("buffer", "frozen"):
            stored = meta.states["param"].dtype
            plans.append(TensorPlan(meta.name, meta.shape, meta.dtype, meta.kind, None,
                                    _states((_state("param", "param", stored, stored),))))
            continue
        master = meta.states["master"].dtype
        dtype = as_dtype(param_dtype) if param_dtype is not None else master
        states = [_state("param", "master", dtype, master)]
        if dtype != FLOAT32:
            states.append(_state("master_param", "master", FLOAT32, master))
        recorded = recorded_use_muon(meta, optimizer)
        default = use_muon_for(meta.name, len(meta.shape))
        muon = default if recorded is None else recorded
        if recorded is not None and recorded != default:
            disagreements.append(Disagreement(meta.name, _label(recorded), _label(default)))
        if muon and len(meta.shape) != 2:
            raise FormatError(f"{where}: {meta.name} {list(meta.shape)} was updated by Muon in the "
                              f"DeepSpeed run; ZeroMuon's Muon takes 2-D parameters only")
        plan = TensorPlan(meta.name, meta.shape, dtype, "param", _label(muon),
                          recorded=recorded, default=default)
        wanted = ("momentum_buffer",) if muon else ADAM_STATES
        held = [k for k in wanted if k in meta.states]
        if len(held) == len(wanted):
            states += [_state(k, k, meta.states[k].dtype, meta.states[k].dtype) for k in wanted]
            if not muon:
                plan.adam_step = meta.extra.get("adam_step")
                if plan.adam_step is None:
                    raise FormatError(f"{where}: {meta.name} has Adam moments but no step count")
        elif recorded is not None:
            raise FormatError(f"{where}: {meta.name} was updated by {_label(muon)} but its "
                              f"{', '.join(k for k in wanted if k not in held)} is not in the "
                              f"optimizer files")
        else:
            # no optimizer state at all: the parameter resumes with fresh state, which the
            # loader allows only when nothing but ``param`` is saved
            states = [s for s in states if s.key == "param"]
            notes.append(f"{meta.name}: no optimizer state in the checkpoint; it resumes with "
                         f"fresh {_label(muon)} state")
        plan.states = _states(tuple(states))
        plans.append(plan)
    if optimizer == "adam":
        notes.append("the DeepSpeed run used Adam with L2 weight decay (not AdamW); ZeroMuon's "
                     "AdamW decouples weight decay, so steps differ where weight_decay != 0")
    return plans, disagreements, notes
