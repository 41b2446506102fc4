"""One optimizer step over the bundles: state in from the store, math, exchange, state out.

A Muon bundle passes three stages, each a method here:

1. ``pack``: for each bucket row, acquire the momentum (and master) bucket, update the
   momentum on the local box, write the Nesterov input U as bf16 into the slot's send
   buffer (where this rank is its box's source: ``comm.py``), release the momentum
   (dirty); start all_to_all #1.
2. ``orthogonalize``: wait for #1; per owned matrix, copy its pieces (boxes) into the
   Newton-Schulz workspace, run Newton-Schulz, write each holder's box of O into the back
   send buffer (over the received pieces, when no box is replicated); start all_to_all #2.
3. ``apply``: wait for #2; decay and update the local box (or the master, then copy it
   to the bf16 parameter); release the master buckets.

Every stage works on a ``resources.StepResources`` (made once by the optimizer: store,
layout, exchange plans, buffers) and a ``StepContext`` (what changes each step); state
arrays are found by their ``StateKind``, never by name.

``MuonPipeline`` keeps three bundles in flight (pack k, orthogonalize k-1, apply k-2), so
the exchange of one bundle overlaps the compute of others, and advances one stage after
each AdamW bundle (elementwise, no communication) so that work fills exchange time too.
Every rank issues its collectives in the same order: stages advance at points that depend
only on the bundle sequence, never on timing.

A bucket that several rows use (a bundle's first or last bucket may hold its neighbours'
state) goes back to the store only when the last of them is done (``step_events.Leases``),
so it is read and written once per step. ``step_events.step_events`` lists the store calls
this module makes; the planner replays them.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from .adamw_math import adamw_update_
from .groups import scalar
from .muon_math import adjusted_lr, apply_update_, momentum_update_, nesterov_input
from .resources import StepResources
from .state_layout import StateKind
from .step_events import SLOTS, Leases

_ADAM_KINDS = (StateKind.EXP_AVG, StateKind.EXP_AVG_SQ, StateKind.MAX_EXP_AVG_SQ)


class StepContext:
    """What one step needs that changes from step to step."""

    def __init__(self, reverse: bool, active: set[int], fresh: set[int], params_flat: dict,
                 grads_flat: dict, steps: dict, leases: Leases):
        self.reverse = reverse
        self.leases = leases          # shared buckets: released when their last row is done
        self.active = active          # parameters with a gradient
        self.fresh = fresh            # active and never stepped: masters start from the parameter
        self.params_flat = params_flat
        self.grads_flat = grads_flat
        self.steps = steps            # AdamW parameter -> step count (already incremented)
        self.lent: dict[int, object] = {}  # handles acquired and not yet released, by id
        self.comm_wait_s = 0.0
        self.ns_s = 0.0


class StepRunner:
    """The math of each stage, over one rank's ``StepResources``."""

    def __init__(self, res: StepResources):
        self.res = res

    # -- helpers -------------------------------------------------------------------------------
    def _rows(self, bundle, ctx):
        return reversed(bundle.rows) if ctx.reverse else bundle.rows

    def _acquire_row(self, row, ctx, names=None):
        names = list(row.buckets) if names is None else names
        if ctx.reverse:
            names = names[::-1]
        res = self.res
        handles = {}
        for n in names:  # one at a time: a failed acquire leaves the others in ctx.lent
            h = handles[n] = res.store.acquire(res.array_name(n), row.buckets[n],
                                               device=res.device)
            ctx.lent[id(h)] = h
        return handles

    def _release(self, ctx, row, name, handle, dirty: bool) -> None:
        """This row is done with ``name``'s bucket (``handle`` None: it skipped it)."""
        item = None if handle is None else (handle, dirty)
        for h, d in ctx.leases.done((name, row.buckets[name]), item):
            self.res.store.release(h, dirty=d)
            ctx.lent.pop(id(h), None)

    def give_back(self, ctx) -> None:
        """After a step failed part way (an I/O error in an acquire): release every handle
        it still holds, as dirty, since the step may have changed their bytes already, so
        that nothing of it is lost and the store has its buckets back for the next step."""
        lent, ctx.lent = list(ctx.lent.values()), {}
        for h in lent:
            try:
                self.res.store.release(h, dirty=True)
            except Exception:  # a store already closed: nothing left to give back to
                pass

    def _grad(self, ctx, seg, master: bool):
        g = ctx.grads_flat[seg.param][seg.lo:seg.hi]
        if master:
            return self.res.scratch.get("grad", torch.float32, seg.hi - seg.lo).copy_(g)
        return g

    def _master_seg(self, handle, seg, ctx):
        m = handle.tensor[seg.offset:seg.offset + seg.hi - seg.lo]
        if seg.param in ctx.fresh:
            m.copy_(ctx.params_flat[seg.param][seg.lo:seg.hi])
        return m

    # -- Muon ------------------------------------------------------------------------------------
    def pack(self, bundle, slot, ctx) -> list:
        """Momentum update and bf16 U into the send buffer; returns held master handles."""
        res = self.res
        plan = res.plans[bundle.index]
        send, _ = res.exchange.buffers(slot, plan)
        mom = bundle.key(StateKind.MOMENTUM).name
        master = bundle.key(StateKind.MASTER)
        held = []
        for row in self._rows(bundle, ctx):
            handles = self._acquire_row(row, ctx)
            touched = False
            for seg in row.segments:
                if seg.param not in ctx.active:
                    continue
                touched = True
                g = res.infos[seg.param].group
                n = seg.hi - seg.lo
                grad = self._grad(ctx, seg, master is not None)
                buf = handles[mom].tensor[seg.offset:seg.offset + n]
                momentum_update_(buf, grad, g["momentum"])
                out = plan.send_offset.get(seg.param)
                if out is not None:  # else a replica of this box sends it
                    u = nesterov_input(grad, buf, g["momentum"], g["nesterov"],
                                       out=res.scratch.get("u", buf.dtype, n))
                    send[out + seg.lo:out + seg.lo + n].copy_(u)
                if master is not None:  # first step: the master starts from the parameter
                    self._master_seg(handles[master.name], seg, ctx)
            self._release(ctx, row, mom, handles[mom], touched)
            if master is not None:
                held.append((row, handles[master.name], touched))
        return held

    def orthogonalize(self, bundle, slot, ctx) -> None:
        """Newton-Schulz on every matrix this rank owns in ``bundle``; each holder's box of O
        goes to the back send buffer (over U's pieces, when the way back is the way out)."""
        res = self.res
        plan = res.plans[bundle.index]
        _, recv = res.exchange.buffers(slot, plan)
        back, _ = res.exchange.back_buffers(slot, plan)
        t0 = time.perf_counter()
        for om in plan.owned:
            if om.param not in ctx.active:
                continue
            g = res.infos[om.param].group
            x = res.ns.input(om.rows, om.cols)
            for pc in om.pieces:
                x[pc.box.slices()].copy_(recv[pc.offset:pc.offset + pc.numel].view(pc.box.shape))
            out = res.ns.run(om.rows, om.cols, g["ns_coefficients"], g["ns_steps"], g["eps"])
            for pc in om.returns:
                back[pc.offset:pc.offset + pc.numel].view(pc.box.shape).copy_(out[pc.box.slices()])
        ctx.ns_s += time.perf_counter() - t0

    def apply(self, bundle, slot, ctx, held) -> None:
        """Decay and orthogonalized step on the local box (or master); release masters."""
        res = self.res
        plan = res.plans[bundle.index]
        _, back = res.exchange.back_buffers(slot, plan)
        masters = {id(row): (h, touched) for row, h, touched in held}
        master = bundle.key(StateKind.MASTER)
        for row in self._rows(bundle, ctx):
            mh = masters.get(id(row))
            for seg in row.segments:
                if seg.param not in ctx.active:
                    continue
                info = res.infos[seg.param]
                g = info.group
                lr = scalar(g["lr"])
                n = seg.hi - seg.lo
                start = plan.back_offset[seg.param] + seg.lo
                update = back[start:start + n]
                p = ctx.params_flat[seg.param][seg.lo:seg.hi]
                target = p if mh is None else mh[0].tensor[seg.offset:seg.offset + n]
                apply_update_(target, update, lr, g["weight_decay"],
                              adjusted_lr(lr, g["adjust_lr_fn"], info.shape))
                if mh is not None:
                    p.copy_(target)
            if mh is not None:
                self._release(ctx, row, master.name, mh[0], mh[1])

    # -- AdamW -----------------------------------------------------------------------------------
    def adamw_bundle(self, bundle, ctx) -> None:
        res = self.res
        master = bundle.key(StateKind.MASTER)
        names = {k: (bundle.key(k).name if bundle.key(k) is not None else None) for k in _ADAM_KINDS}
        for row in self._rows(bundle, ctx):
            if not any(s.param in ctx.active for s in row.segments):
                for n in row.buckets:
                    self._release(ctx, row, n, None, False)
                continue
            handles = self._acquire_row(row, ctx)
            for seg in row.segments:
                if seg.param not in ctx.active:
                    continue
                g = res.infos[seg.param].group
                n = seg.hi - seg.lo
                view = lambda k: handles[names[k]].tensor[seg.offset:seg.offset + n]
                grad = self._grad(ctx, seg, master is not None)
                p = ctx.params_flat[seg.param][seg.lo:seg.hi]
                target = self._master_seg(handles[master.name], seg, ctx) if master is not None else p
                beta1, beta2 = g["betas"]
                adamw_update_(target, grad, view(StateKind.EXP_AVG), view(StateKind.EXP_AVG_SQ),
                              view(StateKind.MAX_EXP_AVG_SQ) if g["amsgrad"] else None,
                              res.scratch.get("denom", target.dtype, n),
                              step=ctx.steps[seg.param], lr=scalar(g["lr"]), beta1=scalar(beta1),
                              beta2=scalar(beta2), eps=g["eps"], weight_decay=g["weight_decay"],
                              amsgrad=g["amsgrad"], maximize=g["maximize"])
                if master is not None:
                    p.copy_(target)
            for n, h in handles.items():
                self._release(ctx, row, n, h, True)


class MuonPipeline:
    """Three Muon bundles in flight; stages advance at fixed points of the bundle sequence."""

    def __init__(self, runner: StepRunner, ctx: StepContext):
        self.r, self.ctx = runner, ctx
        self.to_orthogonalize: deque = deque()
        self.to_apply: deque = deque()
        self.next_slot = 0

    def push(self, bundle) -> None:
        slot = self.next_slot
        self.next_slot = (slot + 1) % SLOTS
        held = self.r.pack(bundle, slot, self.ctx)
        res = self.r.res
        work = res.exchange.forward(slot, res.plans[bundle.index])
        self.to_orthogonalize.append((bundle, slot, work, held))
        while len(self.to_orthogonalize) > 1:
            self._orthogonalize_oldest()
        while len(self.to_apply) > 1:
            self._apply_oldest()

    def advance(self) -> None:
        """One stage of the oldest bundle in flight (called after each AdamW bundle)."""
        if self.to_apply:
            self._apply_oldest()
        elif self.to_orthogonalize:
            self._orthogonalize_oldest()

    def drain(self) -> None:
        while self.to_orthogonalize:
            self._orthogonalize_oldest()
        while self.to_apply:
            self._apply_oldest()

    def _wait(self, work) -> None:
        if work is not None:
            t0 = time.perf_counter()
            work.wait()
            self.ctx.comm_wait_s += time.perf_counter() - t0

    def _orthogonalize_oldest(self) -> None:
        bundle, slot, work, held = self.to_orthogonalize.popleft()
        self._wait(work)
        self.r.orthogonalize(bundle, slot, self.ctx)
        res = self.r.res
        back = res.exchange.backward(slot, res.plans[bundle.index])
        self.to_apply.append((bundle, slot, back, held))

    def _apply_oldest(self) -> None:
        bundle, slot, work, held = self.to_apply.popleft()
        self._wait(work)
        self.r.apply(bundle, slot, self.ctx, held)
