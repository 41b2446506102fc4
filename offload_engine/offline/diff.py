"""Compare two inputs of any kinds: names, shapes and dtypes, then values within tolerance.

Which values are compared (``mode``):

- ``"weights"`` (default): each tensor's value: its master weights where it has them
  (DeepSpeed's ``master``, which ``consolidate`` writes; ZeroMuon's ``master_param``), else
  ``param`` (safetensors, frozen parameters, buffers). A tensor with neither (a live
  store's optimizer state) is compared state by state, as in ``"all"``; against a side
  that holds weights (a store against a checkpoint of the run) only the optimizer states
  count, since a store never holds the weights.
- ``"all"``: every state both sides hold under the same name; states only one side holds
  are listed and count as a difference.
- a list of state names: those states only.

Tied names (DeepSpeed ``shared_params``, safetensors ``alias: owner`` metadata) resolve to
their owner, so a checkpoint compares equal to a consolidated copy that wrote the alias
out as a tensor. Values stream through fixed windows (``window_bytes`` per side).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..formats.source import WEIGHT_STATES, TensorSource, TensorMeta
from ..io import BufferPool
from ..units import MiB
from .select import name_matches

# what a live store holds instead of weights (ZeroMuon's Muon momentum, AdamW's moments)
OPTIMIZER_STATES = ("momentum_buffer", "exp_avg", "exp_avg_sq")


@dataclass
class DiffReport:
    added: list[str] = field(default_factory=list)     # in B only
    removed: list[str] = field(default_factory=list)   # in A only
    changed: list[dict] = field(default_factory=list)  # shape / dtype / state-set changes
    values: list[dict] = field(default_factory=list)   # per compared pair
    ignore_dtype: bool = False

    @property
    def equal(self) -> bool:
        changes = [c for c in self.changed if not (self.ignore_dtype and c["what"] == "dtype")]
        return (not self.added and not self.removed and not changes
                and all(v["equal"] for v in self.values))

    def as_dict(self) -> dict:
        return {"equal": self.equal, "added": self.added, "removed": self.removed,
                "changed": self.changed, "values": self.values}


def _resolve(names: dict[str, TensorMeta], aliases: dict[str, str], name: str):
    if name in names:
        return names[name]
    owner = aliases.get(name)
    return names.get(owner) if owner is not None else None


def _pairs(ta: TensorMeta, tb: TensorMeta, mode, report: DiffReport, label: str):
    """The (state in A, state in B) pairs to compare for one tensor name."""
    common = [s for s in ta.states if s in tb.states]
    states_a, states_b = list(ta.states), list(tb.states)
    if mode == "weights":
        wa, wb = _weights(ta), _weights(tb)
        if wa is not None and wb is not None:
            return [(wa, wb)]
        if (wa is None) != (wb is None):
            # one side is optimizer state alone (a live store): it is compared with the
            # same states of the other, whose weights it never holds
            states_a = [s for s in states_a if s not in WEIGHT_STATES]
            states_b = [s for s in states_b if s not in WEIGHT_STATES]
            common = [s for s in common if s not in WEIGHT_STATES]
        mode = "all"
    if mode == "all":
        only_a = [s for s in states_a if s not in states_b]
        only_b = [s for s in states_b if s not in states_a]
        if only_a or only_b:
            report.changed.append({"name": label, "what": "states", "a": sorted(ta.states),
                                   "b": sorted(tb.states)})
        return [(s, s) for s in common]
    pairs = []
    for s in mode:
        if s in ta.states and s in tb.states:
            pairs.append((s, s))
        elif s in ta.states or s in tb.states:
            report.changed.append({"name": label, "what": "states", "state": s,
                                   "a": s in ta.states, "b": s in tb.states})
    return pairs


def _weights(t: TensorMeta) -> str | None:
    """The state holding ``t``'s weights (master, else param), or None: optimizer state
    alone, as a live store keeps it (its only state is then momentum or a moment, which
    ``weight_state``'s only-state rule would take for weights)."""
    w = t.weight_state()
    return None if w in OPTIMIZER_STATES else w


def diff_sources(a: TensorSource, b: TensorSource, rtol: float = 0.0, atol: float = 0.0,
                 mode: str | Sequence[str] = "weights", names: Sequence[str] | None = None,
                 ignore_dtype: bool = False, window_bytes: int = 16 * MiB,
                 progress: Callable[[int, int], None] | None = None,
                 values: bool = True) -> DiffReport:
    """Compare ``a`` with the reference ``b`` (see the module docstring). With ``values``
    False only names, shapes, dtypes and state sets are compared (metadata: no tensor
    byte is read, torch is not imported)."""
    report = DiffReport(ignore_dtype=ignore_dtype)
    na = {t.name: t for t in a.tensors()}
    nb = {t.name: t for t in b.tensors()}
    aa, ab = a.aliases(), b.aliases()
    wanted = lambda n: name_matches(n, names)
    all_a = [n for n in list(na) + [x for x in aa if x not in na] if wanted(n)]
    all_b = set(n for n in list(nb) + list(ab) if wanted(n))
    report.removed = sorted(n for n in all_a if n not in all_b)
    report.added = sorted(n for n in all_b if n not in set(all_a))
    jobs = []
    for name in all_a:
        if name not in all_b:
            continue
        ta, tb = _resolve(na, aa, name), _resolve(nb, ab, name)
        if ta is None or tb is None:
            continue
        if name in aa and name in ab:
            continue  # an alias on both sides: its owner is compared
        if ta.shape != tb.shape:
            report.changed.append({"name": name, "what": "shape", "a": list(ta.shape),
                                   "b": list(tb.shape)})
            continue
        for sa, sb in _pairs(ta, tb, mode, report, name):
            da, db = ta.states[sa].dtype, tb.states[sb].dtype
            if da != db:
                report.changed.append({"name": name, "what": "dtype",
                                       "state": sa if sa == sb else f"{sa}/{sb}",
                                       "a": da.name, "b": db.name})
            jobs.append((name, ta, tb, sa, sb))
    if values:
        _compare_values(a, b, jobs, report, rtol, atol, window_bytes, progress)
    return report


def _compare_values(a, b, jobs, report: DiffReport, rtol: float, atol: float,
                    window_bytes: int, progress) -> None:
    """Stream each job's two states through ``Comparison`` (torch, imported here)."""
    from .compare import Comparison
    from .inspect_stats import single_thread

    total = sum(ta.numel * (ta.states[sa].dtype.itemsize + tb.states[sb].dtype.itemsize)
                for _, ta, tb, sa, sb in jobs)
    done = 0
    pool = BufferPool(2 * window_bytes)
    try:
        with single_thread():
            for name, ta, tb, sa, sb in jobs:
                cmp = Comparison(rtol, atol)
                da, db = ta.states[sa].dtype, tb.states[sb].dtype
                per = max(1, window_bytes // max(da.itemsize, db.itemsize))
                with pool.acquire(per * da.itemsize) as ba, pool.acquire(per * db.itemsize) as bb:
                    for lo in range(0, ta.numel, per):
                        n = min(per, ta.numel - lo)
                        xa, xb = ba.view(da.torch, n), bb.view(db.torch, n)
                        a.read_state(ta.name, sa, lo, xa)
                        b.read_state(tb.name, sb, lo, xb)
                        cmp.add(xa, xb)
                        done += n * (da.itemsize + db.itemsize)
                        if progress:
                            progress(done, total)
                r = cmp.result()
                r.update(name=name, state=sa if sa == sb else f"{sa}/{sb}")
                report.values.append(r)
    finally:
        pool.close()
