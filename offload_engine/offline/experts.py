"""Mixture-of-experts tensors as the offline tools see them: which tensors are grouped expert
stacks, and a view of a source restricted to one expert (``--expert E`` of inspect, diff
and export).

Two layouts hold experts (docs/consolidate.md, Mixture of experts):

- a **grouped stack**: one 3-D tensor ``[E, out, in]``, dim 0 the expert, one of whose
  modules is named ``experts`` (torchtitan's ``moe.experts.w1 [E, F, D]``, Hugging Face
  5.x's ``mlp.experts.gate_up_proj [E, 2I, H]`` and ``mlp.experts.down_proj [E, H, I]``):
  ZeroMuon's own rule for a stack of expert matrices (``optim.param_rules.is_expert_stack``,
  on the name and number of dimensions, so offline and training agree). Expert ``e`` is elements ``[e * n, (e + 1) * n)`` of
  the flattened stack (``n`` = numel / E): contiguous in every format, so one expert is
  read alone, whatever E;
- **per-expert tensors**: ``...experts.{e}.<name>``, one 2-D weight per expert (a
  ModuleList: Hugging Face 4.x, DeepSpeed's ``deepspeed_experts.{e}``, and what
  ``consolidate --experts per-expert`` writes).

``ExpertView(source, e)`` lists, for expert ``e``, each grouped stack as ``name[e]`` with
the stack's shape less its first dimension, and each per-expert tensor of expert ``e``
under its own name; reads of ``name[e]`` are reads of the stack at ``e``'s offset.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

from ..formats.errors import FormatError
from ..formats.source import ReadRequest, StateMeta, TensorMeta, TensorSource
from ..optim.param_rules import is_expert_stack

_PER_EXPERT = re.compile(r"(?:^|[._])experts\.(\d+)\.")


def expert_count(name: str, shape: Sequence[int]) -> int | None:
    """E for a grouped expert stack (``is_expert_stack``: 3-D, a module named ``experts``
    in ``name``; dim 0 the expert), else None."""
    return int(shape[0]) if is_expert_stack(name, len(shape)) else None


def per_expert_index(name: str) -> int | None:
    """The expert number of a per-expert tensor (``...experts.{e}.w1.weight``), else None."""
    m = _PER_EXPERT.search(name)
    return int(m.group(1)) if m else None


def stack_name(name: str, expert: int) -> str:
    """The name ``ExpertView`` gives expert ``expert`` of stack ``name``: ``name[expert]``."""
    return f"{name}[{expert}]"


def sliced_meta(t: TensorMeta, name: str, shape: Sequence[int], extra: dict) -> TensorMeta:
    """A contiguous part of ``t`` (``prod(shape)`` elements of it) as a tensor of its own,
    called ``name``: every state of the tensor's size cut the same way, states of another
    size (a step count) kept whole. Bytes are listed without ranks: which rank holds an
    expert depends on the mesh."""
    numel = math.prod(shape)
    states = {}
    for s, sm in t.states.items():
        n = numel if sm.numel == t.numel else sm.numel
        states[s] = StateMeta(sm.dtype, n, {None: n * sm.dtype.itemsize})
    return TensorMeta(name, tuple(shape), t.dtype, t.optimizer, states, kind=t.kind,
                      extra=dict(extra))


def state_offset(t: TensorMeta, state: str | None, start: int) -> int:
    """Where a part starting at element ``start`` of tensor ``t`` begins in ``state``
    (None: its value state): ``start`` for states of the tensor's size, 0 for others (read
    whole)."""
    sm = t.states[state if state is not None else t.value_state()]
    return start if sm.numel == t.numel else 0


class ExpertView(TensorSource):
    """``source`` restricted to expert ``expert``: every grouped stack that has it (as
    ``name[expert]``) and every per-expert tensor of that expert. FormatError when no
    tensor holds that expert (the message says how many experts the stacks hold)."""

    def __init__(self, source: TensorSource, expert: int):
        if expert < 0:
            raise FormatError(f"{source.info.path}: expert numbers start at 0, got {expert}")
        self.source, self.expert, self.info = source, expert, source.info
        self._tensors: list[TensorMeta] = []
        self._where: dict[str, tuple[TensorMeta, int]] = {}  # view name -> (source tensor, first element)
        counts = set()
        for t in source.tensors():
            e = expert_count(t.name, t.shape)
            if e is not None:
                counts.add(e)
                if expert < e:
                    n = t.numel // e
                    meta = sliced_meta(t, stack_name(t.name, expert), t.shape[1:],
                                       {"stack": t.name, "expert": expert, "experts": e})
                    self._tensors.append(meta)
                    self._where[meta.name] = (t, expert * n)
            elif per_expert_index(t.name) == expert:
                self._tensors.append(t)
                self._where[t.name] = (t, 0)
        if not self._tensors:
            held = (f"its expert stacks hold {', '.join(map(str, sorted(counts)))} experts"
                    if counts else "it has no expert tensors")
            raise FormatError(f"{source.info.path}: no expert {expert}: {held}")

    def tensors(self) -> list[TensorMeta]:
        return list(self._tensors)

    def resolve(self, name: str) -> str:
        """The view's name for ``name``: itself (a per-expert tensor of this expert, or
        ``stack[e]``), or a stack's name given plain (``layers.0.moe.experts.w1`` ->
        ``layers.0.moe.experts.w1[e]``). FormatError naming the input otherwise."""
        if name in self._where:
            return name
        if stack_name(name, self.expert) in self._where:
            return stack_name(name, self.expert)
        raise FormatError(f"{self.info.path}: {name!r} is neither an expert stack holding "
                          f"expert {self.expert} nor a tensor of expert {self.expert}")

    def _source_key(self, name: str, state: str | None) -> tuple[str, int]:
        """The source tensor behind view name ``name`` and where its part starts in
        ``state`` (elements)."""
        where = self._where.get(name)
        if where is None:
            raise FormatError(f"{self.info.path}: no tensor named {name!r} for expert "
                              f"{self.expert}")
        src, start = where
        return src.name, state_offset(src, state, start)

    def read(self, requests: Sequence[ReadRequest]) -> None:
        mapped = []
        for r in requests:
            src, offset = self._source_key(r.name, r.state)
            mapped.append(ReadRequest(src, offset + r.start, r.out, r.state))
        self.source.read(mapped)

    def check_readable(self, keys: Sequence[tuple[str, str]]) -> None:
        check = getattr(self.source, "check_readable", None)
        if check is not None:
            check([(self._where[n][0].name, s) for n, s in keys])

    def close(self) -> None:
        self.source.close()


def stacks(source: TensorSource) -> dict[str, int]:
    """``{name: E}`` of every grouped expert stack of ``source``, in key order."""
    out = {}
    for t in source.tensors():
        e = expert_count(t.name, t.shape)
        if e is not None:
            out[t.name] = e
    return out

