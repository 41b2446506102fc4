"""One optimizer step: the step schedule executed, with the math at its points.

``step_schedule.step_schedule`` says what a step does and in which order (store calls,
stages, slots; the planner replays the same sequence); ``StepRunner.run`` does it. A Muon
bundle passes three stages, each a method here:

1. ``pack`` (per row, its buckets acquired): update the momentum on the local box, write
   the Nesterov input U as bf16 into the slot's send buffer (where this rank is its box's
   source: ``comm.py``); the schedule then releases the momentum and ``send`` starts
   all_to_all #1.
2. ``orthogonalize``: wait for #1; per owned matrix, copy its pieces (boxes) into the
   Newton-Schulz workspace, run Newton-Schulz, write each holder's box of O into the back
   send buffer (over the received pieces, when no box is replicated); start all_to_all #2.
3. ``receive`` (wait for #2), then ``apply`` per row: decay and update the local box (or
   the master, then copy it to the bf16 parameter); the schedule releases the masters.

An AdamW row is one elementwise update (``adamw``) between its acquires and releases.

Every stage works on a ``resources.StepResources`` (made once by the optimizer: store,
layout, exchange plans, buffers) and a ``StepContext`` (what changes each step: the
handles lent, the exchanges outstanding); state arrays are found by their ``StateKind``,
never by name. A bucket is written back dirty when any parameter of the row that acquired
it had a gradient.
"""

from __future__ import annotations

import time

import torch

from .adamw_math import adamw_update_
from .groups import scalar
from .muon_math import adjusted_lr, apply_update_, momentum_update_, nesterov_input
from .comm import overlaps
from .resources import StepResources
from .state_layout import StateKind
from .step_schedule import Do

_ADAM_KINDS = (StateKind.EXP_AVG, StateKind.EXP_AVG_SQ, StateKind.MAX_EXP_AVG_SQ)


class StepContext:
    """What one step needs that changes from step to step."""

    def __init__(self, reverse: bool, active: set[int], fresh: set[int], params_flat: dict,
                 grads_flat: dict, steps: dict):
        self.reverse = reverse
        self.active = active          # parameters with a gradient
        self.fresh = fresh            # active and never stepped: masters start from the parameter
        self.params_flat = params_flat
        self.grads_flat = grads_flat
        self.steps = steps            # AdamW parameter -> step count (already incremented)
        # handles acquired and not yet released, by (bundle index, row, array name)
        self.lent: dict[tuple[int, int, str], object] = {}
        self.sent: dict[int, object] = {}       # Muon bundle -> all_to_all #1 outstanding
        self.returned: dict[int, object] = {}   # Muon bundle -> all_to_all #2 outstanding
        self._touched: dict[tuple[int, int], bool] = {}
        self.comm_wait_s = 0.0
        self.ns_s = 0.0

    def touched(self, bundle, j: int) -> bool:
        """Whether row ``j`` of ``bundle`` holds a parameter with a gradient (its buckets
        changed: written back dirty)."""
        key = (bundle.index, j)
        if key not in self._touched:
            self._touched[key] = any(s.param in self.active for s in bundle.rows[j].segments)
        return self._touched[key]

    def handle(self, bundle, j: int, kind: StateKind):
        """The handle row ``j`` of ``bundle`` holds on its array of ``kind``."""
        return self.lent[(bundle.index, j, bundle.key(kind).name)]


class StepRunner:
    """The math of each stage, over one rank's ``StepResources``, and the loop that runs a
    step's schedule."""

    def __init__(self, res: StepResources):
        self.res = res

    def run(self, ctx: StepContext, schedule) -> None:
        """Execute ``schedule`` (``step_schedule.step_schedule``'s operations) in order."""
        res = self.res
        store = res.store
        for op in schedule:
            do = op.do
            if do is Do.ACQUIRE:
                array, bucket = op.bucket
                # one at a time: a failed acquire leaves the others in ctx.lent
                ctx.lent[(op.bundle.index, op.row, array)] = store.acquire(
                    res.array_name(array), bucket, device=res.device)
            elif do is Do.RELEASE:
                key = (op.bundle.index, op.row, op.array)
                store.release(ctx.lent[key], dirty=ctx.touched(op.bundle, op.row))
                del ctx.lent[key]
            elif do is Do.PACK:
                self.pack(op.bundle, op.row, op.slot, ctx)
            elif do is Do.SEND:
                ctx.sent[op.bundle.index] = res.exchange.forward(op.slot,
                                                                 res.plans[op.bundle.index])
            elif do is Do.ORTHOGONALIZE:
                self._wait(ctx, ctx.sent.pop(op.bundle.index))
                self.orthogonalize(op.bundle, op.slot, ctx)
                ctx.returned[op.bundle.index] = res.exchange.backward(
                    op.slot, res.plans[op.bundle.index])
            elif do is Do.RECEIVE:
                self._wait(ctx, ctx.returned.pop(op.bundle.index))
            elif do is Do.APPLY:
                self.apply(op.bundle, op.row, op.slot, ctx)
            elif do is Do.ADAMW:
                self.adamw(op.bundle, op.row, ctx)
            else:
                raise AssertionError(f"unknown operation {op}")

    @staticmethod
    def _wait(ctx, work) -> None:
        if work is not None:
            t0 = time.perf_counter()
            work.wait()
            ctx.comm_wait_s += time.perf_counter() - t0

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
    def pack(self, bundle, j: int, slot: int, ctx) -> None:
        """Row ``j``: momentum update and bf16 U into the send buffer of ``slot``; a fresh
        parameter's master starts from the parameter."""
        res = self.res
        plan = res.plans[bundle.index]
        send = res.exchange.kept_buffer(slot, plan)   # runs index it whole
        master = bundle.key(StateKind.MASTER)
        mom = ctx.handle(bundle, j, StateKind.MOMENTUM)
        for seg in bundle.rows[j].segments:
            if seg.param not in ctx.active:
                continue
            g = res.infos[seg.param].group
            n = seg.hi - seg.lo
            grad = self._grad(ctx, seg, master is not None)
            buf = mom.tensor[seg.offset:seg.offset + n]
            momentum_update_(buf, grad, g["momentum"])
            runs = plan.send_runs.get(seg.param)
            if runs:  # else a replica of this box sends it
                u = nesterov_input(grad, buf, g["momentum"], g["nesterov"],
                                   out=res.scratch.get("u", buf.dtype, n))
                # one run per matrix: a stack's experts may go to different owners
                for a, b, at, _ in overlaps(runs, seg.lo, seg.hi):
                    send[at:at + b - a].copy_(u[a - seg.lo:b - seg.lo])
            if master is not None:  # first step: the master starts from the parameter
                self._master_seg(ctx.handle(bundle, j, StateKind.MASTER), seg, ctx)

    def orthogonalize(self, bundle, slot, ctx) -> None:
        """Newton-Schulz on every matrix this rank owns in ``bundle``; each holder's box of O
        goes to the back send buffer (over U's pieces, when the way back is the way out)."""
        res = self.res
        plan = res.plans[bundle.index]
        _, recv = res.exchange.buffers(slot, plan)
        back, _ = res.exchange.back_buffers(slot, plan)
        kept = res.exchange.kept_buffer(slot, plan)
        t0 = time.perf_counter()
        # exchanged matrices: pieces from the receive buffer, O to the back send buffer;
        # kept ones (held whole here alone): U and O in place in the send buffer
        for matrices, src, dst in ((plan.owned, recv, back), (plan.kept, kept, kept)):
            for om in matrices:
                if om.param not in ctx.active:
                    continue
                g = res.infos[om.param].group
                x = res.ns.input(om.rows, om.cols)
                for pc in om.pieces:
                    x[pc.box.slices()].copy_(src[pc.offset:pc.offset + pc.numel].view(pc.box.shape))
                out = res.ns.run(om.rows, om.cols, g["ns_coefficients"], g["ns_steps"], g["eps"])
                for pc in om.returns:
                    dst[pc.offset:pc.offset + pc.numel].view(pc.box.shape).copy_(out[pc.box.slices()])
        ctx.ns_s += time.perf_counter() - t0

    def apply(self, bundle, j: int, slot: int, ctx) -> None:
        """Row ``j``: decay and orthogonalized step on the local box (or master)."""
        res = self.res
        plan = res.plans[bundle.index]
        _, back = res.exchange.back_buffers(slot, plan)
        kept = res.exchange.kept_buffer(slot, plan)
        mh = ctx.handle(bundle, j, StateKind.MASTER) if bundle.key(StateKind.MASTER) else None
        for seg in bundle.rows[j].segments:
            if seg.param not in ctx.active:
                continue
            info = res.infos[seg.param]
            g = info.group
            lr = scalar(g["lr"])
            # from each matrix's own shape: an expert's slice of a stack, as torch Muon on it
            lr_adjusted = adjusted_lr(lr, g["adjust_lr_fn"], info.matrix_shape)
            n = seg.hi - seg.lo
            p = ctx.params_flat[seg.param][seg.lo:seg.hi]
            target = p if mh is None else mh.tensor[seg.offset:seg.offset + n]
            for a, b, at, in_place in overlaps(plan.back_runs[seg.param], seg.lo, seg.hi):
                update = (kept if in_place else back)[at:at + b - a]
                apply_update_(target[a - seg.lo:b - seg.lo], update, lr, g["weight_decay"],
                              lr_adjusted)
            if mh is not None:
                p.copy_(target)

    # -- AdamW -----------------------------------------------------------------------------------
    def adamw(self, bundle, j: int, ctx) -> None:
        """Row ``j``: the AdamW update of every segment with a gradient."""
        res = self.res
        master = bundle.key(StateKind.MASTER)
        views = {k: ctx.handle(bundle, j, k).tensor for k in _ADAM_KINDS if bundle.key(k)}
        mh = ctx.handle(bundle, j, StateKind.MASTER) if master is not None else None
        for seg in bundle.rows[j].segments:
            if seg.param not in ctx.active:
                continue
            g = res.infos[seg.param].group
            n = seg.hi - seg.lo
            view = lambda k: views[k][seg.offset:seg.offset + n]
            grad = self._grad(ctx, seg, master is not None)
            p = ctx.params_flat[seg.param][seg.lo:seg.hi]
            target = self._master_seg(mh, seg, ctx) if mh is not None else p
            beta1, beta2 = g["betas"]
            adamw_update_(target, grad, view(StateKind.EXP_AVG), view(StateKind.EXP_AVG_SQ),
                          view(StateKind.MAX_EXP_AVG_SQ) if g["amsgrad"] else None,
                          res.scratch.get("denom", target.dtype, n),
                          step=ctx.steps[seg.param], lr=scalar(g["lr"]), beta1=scalar(beta1),
                          beta2=scalar(beta2), eps=g["eps"], weight_decay=g["weight_decay"],
                          amsgrad=g["amsgrad"], maximize=g["maximize"])
            if master is not None:
                p.copy_(target)
