"""The step schedule: the one order of a ZeroMuon step's store calls and stages, as data.

``step_schedule(layout, reverse, active)`` is a pure function (no torch, no store) from the
state layout, the step's walking direction and the parameters with a gradient to the
sequence of operations a step performs. The step runner (``pipeline.StepRunner.run``)
executes it, with the math at the ``PACK``/``ORTHOGONALIZE``/``APPLY``/``ADAMW`` points and
the store calls at ``ACQUIRE``/``RELEASE``; the planner (``plan/step_sim.py``) replays its
store calls (``store_calls``) against the store's policy. There is no second copy.

The order:

- The step walks the bundles, reversed on alternate steps (``reverse``: the store says
  which), and each bundle's rows (a row: the bucket of each of the bundle's arrays at one
  position) the same way, a row's arrays too.
- Muon bundle: per row, acquire its buckets, ``PACK`` (momentum update, Nesterov input into
  the send buffer of the bundle's slot), release the momentum; then ``SEND`` (all_to_all #1
  starts). The other arrays' buckets (masters) stay acquired until the bundle's apply
  stage. ``ORTHOGONALIZE`` (wait for #1, Newton-Schulz, all_to_all #2 starts) and
  ``RECEIVE`` (wait for #2) then per row ``APPLY`` and the release of its other buckets come
  later: ``SLOTS`` bundles are in flight (pack k, orthogonalize k-1, apply k-2), each in its
  own slot of exchange buffers, so the exchange of one overlaps the compute of others.
- AdamW bundle: per row, acquire its buckets, ``ADAMW``, release them; then the oldest
  Muon bundle in flight advances one stage (an AdamW bundle fills exchange time). A row
  none of whose parameters has a gradient is not acquired.
- At the end the bundles in flight finish in order.

A bucket several rows use (the layout packs bundles back to back, so a bundle's first and
last buckets may be its neighbours' too) is released only when its last user of the step
is done (``Leases``): between two uses it stays acquired, so the store neither evicts nor
re-reads it and a step reads and writes it once. A ``RELEASE`` names the row whose
``ACQUIRE`` it ends, so a shared bucket's releases come together, in the order acquired.

Collectives (``SEND``, ``ORTHOGONALIZE``) depend only on the bundles and the direction,
never on ``active`` or timing: every rank issues them in the same order.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterator
from typing import NamedTuple

from .state_layout import StateKind

SLOTS = 3  # bundles in flight, each in its own slot of exchange buffers


class Do(enum.Enum):
    """What an operation of the schedule does."""

    ACQUIRE = "acquire"              # store: acquire one row's bucket of one array
    RELEASE = "release"              # store: release what the ACQUIRE of (bundle, row, array) got
    PACK = "pack"                    # Muon row: momentum update, U into the slot's send buffer
    SEND = "send"                    # Muon bundle: all_to_all #1 starts
    ORTHOGONALIZE = "orthogonalize"  # Muon bundle: wait #1, Newton-Schulz, all_to_all #2 starts
    RECEIVE = "receive"              # Muon bundle: wait #2
    APPLY = "apply"                  # Muon row: decay and update the local box (or master)
    ADAMW = "adamw"                  # AdamW row: the elementwise update


STORE_CALLS = (Do.ACQUIRE, Do.RELEASE)


class Op(NamedTuple):
    """One operation: what, on which bundle, row (its position in ``bundle.rows``) and
    array (a layout array name), and the Muon bundle's slot of exchange buffers."""

    do: Do
    bundle: object                   # state_layout.Bundle
    row: int | None = None
    array: str | None = None
    slot: int | None = None

    @property
    def bucket(self) -> tuple[str, int]:
        """(array, bucket index) of a store call."""
        return self.array, self.bundle.rows[self.row].buckets[self.array]


class Leases:
    """Release bookkeeping for one step: a bucket used by several rows goes back to the
    store when all of them are done with it.

    ``done(key, item)`` is called once per row that uses ``key`` (``item`` None for a row
    that skipped it) and returns the items to release now: nothing while other rows of
    the step still need the bucket, else every item held back so far plus this one.
    """

    def __init__(self, uses: dict):
        self.left = {k: n for k, n in uses.items() if n > 1}
        self.held: dict = {}

    def done(self, key, item) -> list:
        n = self.left.get(key)
        if n is None:
            return [] if item is None else [item]
        held = self.held.setdefault(key, [])
        if item is not None:
            held.append(item)
        if n > 1:
            self.left[key] = n - 1
            return []
        del self.left[key]
        return self.held.pop(key)

    def pending(self) -> int:
        """Items held back (0 at the end of a complete step)."""
        return sum(len(v) for v in self.held.values())


def step_schedule(layout, reverse: bool, active: set[int] | None = None) -> Iterator[Op]:
    """The operations of one step, in order (see the module docstring). ``layout``: the
    state layout (``state_layout.Layout``); ``reverse``: walk backwards (the store's
    ``step_is_backward``); ``active``: indices of the parameters with a gradient (None:
    all of them, what the planner assumes)."""
    leases = Leases(layout.uses())
    to_orthogonalize: deque = deque()   # (bundle, slot) packed and sent
    to_apply: deque = deque()           # (bundle, slot) orthogonalized, sent back
    next_slot = 0

    def rows(bundle):
        return range(len(bundle.rows) - 1, -1, -1) if reverse else range(len(bundle.rows))

    def names(bundle, j):
        out = list(bundle.rows[j].buckets)
        return out[::-1] if reverse else out

    def release(bundle, j, name, acquired: bool):
        item = (bundle, j) if acquired else None
        for b, i in leases.done((name, bundle.rows[j].buckets[name]), item):
            yield Op(Do.RELEASE, b, i, name)

    def orthogonalize_oldest():
        bundle, slot = to_orthogonalize.popleft()
        yield Op(Do.ORTHOGONALIZE, bundle, slot=slot)
        to_apply.append((bundle, slot))

    def apply_oldest():
        bundle, slot = to_apply.popleft()
        yield Op(Do.RECEIVE, bundle, slot=slot)
        mom = bundle.key(StateKind.MOMENTUM).name
        for j in rows(bundle):
            yield Op(Do.APPLY, bundle, j, slot=slot)
            for n in names(bundle, j):
                if n != mom:  # the momentum went back after PACK
                    yield from release(bundle, j, n, True)

    for bundle in (layout.bundles[::-1] if reverse else layout.bundles):
        if bundle.kind == "muon":
            slot, next_slot = next_slot, (next_slot + 1) % SLOTS
            mom = bundle.key(StateKind.MOMENTUM).name
            for j in rows(bundle):
                for n in names(bundle, j):
                    yield Op(Do.ACQUIRE, bundle, j, n)
                yield Op(Do.PACK, bundle, j, slot=slot)
                yield from release(bundle, j, mom, True)
            yield Op(Do.SEND, bundle, slot=slot)
            to_orthogonalize.append((bundle, slot))
            while len(to_orthogonalize) > 1:
                yield from orthogonalize_oldest()
            while len(to_apply) > 1:
                yield from apply_oldest()
            continue
        for j in rows(bundle):
            row = bundle.rows[j]
            if active is not None and not any(s.param in active for s in row.segments):
                for n in row.buckets:  # skipped: its users' count goes down all the same
                    yield from release(bundle, j, n, False)
                continue
            for n in names(bundle, j):
                yield Op(Do.ACQUIRE, bundle, j, n)
            yield Op(Do.ADAMW, bundle, j)
            for n in names(bundle, j):
                yield from release(bundle, j, n, True)
        if to_apply:   # the oldest Muon bundle in flight advances one stage
            yield from apply_oldest()
        elif to_orthogonalize:
            yield from orthogonalize_oldest()
    while to_orthogonalize:
        yield from orthogonalize_oldest()
    while to_apply:
        yield from apply_oldest()
    assert leases.pending() == 0, "a shared bucket was not released"


def store_calls(layout, reverse: bool, active: set[int] | None = None
                ) -> list[tuple[str, tuple[str, int]]]:
    """("acquire" | "release", (array, bucket)) in the order a step issues them to the
    store: the schedule's store calls, what the planner replays."""
    return [(op.do.value, op.bucket) for op in step_schedule(layout, reverse, active)
            if op.do in STORE_CALLS]
