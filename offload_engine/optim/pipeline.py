"""One optimizer step over the chunks: state in from the store, math, exchange, state out.

A Muon chunk passes three stages, each a method here:

1. ``pack``: for each bucket row, acquire the momentum (and master) bucket, update the
   momentum on the local shard, write the Nesterov input U as bf16 into the slot's send
   buffer, release the momentum (dirty); start all_to_all #1.
2. ``orthogonalize``: wait for #1; per owned matrix, gather its row blocks into the
   Newton-Schulz workspace, run Newton-Schulz, write O over the received rows; start
   all_to_all #2.
3. ``apply``: wait for #2; decay and update the local shard (or the master, then copy it
   to the bf16 parameter); release the master buckets.

``MuonPipeline`` keeps three chunks in flight (pack k, orthogonalize k-1, apply k-2), so
the exchange of one chunk overlaps the compute of others, and advances one stage after
each AdamW chunk (elementwise, no communication) so that work fills exchange time too.
Every rank issues its collectives in the same order: stages advance at points that depend
only on the chunk sequence, never on timing.

A bucket that several rows use (a chunk's first or last bucket may hold its neighbours'
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
from .state_layout import EXP_AVG, EXP_AVG_SQ, MASTER, MAX_EXP_AVG_SQ, MOMENTUM
from .step_events import SLOTS, Leases


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
        self.comm_wait_s = 0.0
        self.ns_s = 0.0


class StepRunner:
    """The math of each stage, over one optimizer's layout, store and buffers."""

    def __init__(self, opt):
        self.o = opt

    # -- helpers -------------------------------------------------------------------------------
    def _rows(self, chunk, ctx):
        return reversed(chunk.rows) if ctx.reverse else chunk.rows

    def _acquire_row(self, row, ctx, names=None):
        names = list(row.buckets) if names is None else names
        if ctx.reverse:
            names = names[::-1]
        o = self.o
        return {n: o.store.acquire(o.array_name(n), row.buckets[n], device=o.device) for n in names}

    def _release(self, ctx, row, name, handle, dirty: bool) -> None:
        """This row is done with ``name``'s bucket (``handle`` None: it skipped it)."""
        item = None if handle is None else (handle, dirty)
        for h, d in ctx.leases.done((name, row.buckets[name]), item):
            self.o.store.release(h, dirty=d)

    def _grad(self, ctx, seg, master: bool):
        g = ctx.grads_flat[seg.param][seg.lo:seg.hi]
        if master:
            return self.o.scratch("grad", torch.float32, seg.hi - seg.lo).copy_(g)
        return g

    def _master_seg(self, handle, seg, ctx):
        m = handle.tensor[seg.offset:seg.offset + seg.hi - seg.lo]
        if seg.param in ctx.fresh:
            m.copy_(ctx.params_flat[seg.param][seg.lo:seg.hi])
        return m

    # -- Muon ------------------------------------------------------------------------------------
    def pack(self, chunk, slot, ctx) -> list:
        """Momentum update and bf16 U into the send buffer; returns held master handles."""
        o = self.o
        plan = o.plans[chunk.index]
        send, _ = o.exchange.buffers(slot, plan)
        mom = next(n for n in chunk.arrays if n.startswith(MOMENTUM))
        has_master = MASTER in chunk.arrays
        held = []
        for row in self._rows(chunk, ctx):
            handles = self._acquire_row(row, ctx)
            touched = False
            for seg in row.segments:
                if seg.param not in ctx.active:
                    continue
                touched = True
                g = o.infos[seg.param].group
                n = seg.hi - seg.lo
                grad = self._grad(ctx, seg, has_master)
                buf = handles[mom].tensor[seg.offset:seg.offset + n]
                momentum_update_(buf, grad, g["momentum"])
                u = nesterov_input(grad, buf, g["momentum"], g["nesterov"],
                                   out=o.scratch("u", buf.dtype, n))
                start = plan.send_offset[seg.param] + seg.lo
                send[start:start + n].copy_(u)
                if has_master:
                    self._master_seg(handles[MASTER], seg, ctx)  # first step: start from the param
            self._release(ctx, row, mom, handles[mom], touched)
            if has_master:
                held.append((row, handles[MASTER], touched))
        return held

    def orthogonalize(self, chunk, slot, ctx) -> None:
        """Newton-Schulz on every matrix this rank owns in ``chunk``; O replaces U in place."""
        o = self.o
        plan = o.plans[chunk.index]
        _, recv = o.exchange.buffers(slot, plan)
        t0 = time.perf_counter()
        for om in plan.owned:
            if om.param not in ctx.active:
                continue
            g = o.infos[om.param].group
            cols = om.cols
            x = o.ns.input(om.rows, cols).view(-1)
            for pc in om.pieces:
                x[pc.row_start * cols:(pc.row_start + pc.rows) * cols].copy_(
                    recv[pc.offset:pc.offset + pc.rows * cols])
            out = o.ns.run(om.rows, cols, g["ns_coefficients"], g["ns_steps"], g["eps"])
            for pc in om.pieces:
                recv[pc.offset:pc.offset + pc.rows * cols].view(pc.rows, cols).copy_(
                    out[pc.row_start:pc.row_start + pc.rows])
        ctx.ns_s += time.perf_counter() - t0

    def apply(self, chunk, slot, ctx, held) -> None:
        """Decay and orthogonalized step on the local shard (or master); release masters."""
        o = self.o
        plan = o.plans[chunk.index]
        send, _ = o.exchange.buffers(slot, plan)
        masters = {id(row): (h, touched) for row, h, touched in held}
        for row in self._rows(chunk, ctx):
            mh = masters.get(id(row))
            for seg in row.segments:
                if seg.param not in ctx.active:
                    continue
                info = o.infos[seg.param]
                g = info.group
                lr = scalar(g["lr"])
                n = seg.hi - seg.lo
                start = plan.send_offset[seg.param] + seg.lo
                update = send[start:start + n]
                p = ctx.params_flat[seg.param][seg.lo:seg.hi]
                target = p if mh is None else mh[0].tensor[seg.offset:seg.offset + n]
                apply_update_(target, update, lr, g["weight_decay"],
                              adjusted_lr(lr, g["adjust_lr_fn"], info.shape))
                if mh is not None:
                    p.copy_(target)
            if mh is not None:
                self._release(ctx, row, MASTER, mh[0], mh[1])

    # -- AdamW -----------------------------------------------------------------------------------
    def adamw_chunk(self, chunk, ctx) -> None:
        o = self.o
        has_master = MASTER in chunk.arrays
        names = {k: next((n for n in chunk.arrays if n.startswith(k) and
                          (k != EXP_AVG or not n.startswith(EXP_AVG_SQ))), None)
                 for k in (EXP_AVG, EXP_AVG_SQ, MAX_EXP_AVG_SQ)}
        for row in self._rows(chunk, ctx):
            if not any(s.param in ctx.active for s in row.segments):
                for n in row.buckets:
                    self._release(ctx, row, n, None, False)
                continue
            handles = self._acquire_row(row, ctx)
            for seg in row.segments:
                if seg.param not in ctx.active:
                    continue
                g = o.infos[seg.param].group
                n = seg.hi - seg.lo
                view = lambda k: handles[names[k]].tensor[seg.offset:seg.offset + n]
                grad = self._grad(ctx, seg, has_master)
                p = ctx.params_flat[seg.param][seg.lo:seg.hi]
                target = self._master_seg(handles[MASTER], seg, ctx) if has_master else p
                beta1, beta2 = g["betas"]
                adamw_update_(target, grad, view(EXP_AVG), view(EXP_AVG_SQ),
                              view(MAX_EXP_AVG_SQ) if g["amsgrad"] else None,
                              o.scratch("denom", target.dtype, n),
                              step=ctx.steps[seg.param], lr=scalar(g["lr"]), beta1=scalar(beta1),
                              beta2=scalar(beta2), eps=g["eps"], weight_decay=g["weight_decay"],
                              amsgrad=g["amsgrad"], maximize=g["maximize"])
                if has_master:
                    p.copy_(target)
            for n, h in handles.items():
                self._release(ctx, row, n, h, True)


class MuonPipeline:
    """Three Muon chunks in flight; stages advance at fixed points of the chunk sequence."""

    def __init__(self, runner: StepRunner, ctx: StepContext):
        self.r, self.ctx = runner, ctx
        self.to_orthogonalize: deque = deque()
        self.to_apply: deque = deque()
        self.next_slot = 0

    def push(self, chunk) -> None:
        slot = self.next_slot
        self.next_slot = (slot + 1) % SLOTS
        held = self.r.pack(chunk, slot, self.ctx)
        work = self.r.o.exchange.forward(slot, self.r.o.plans[chunk.index])
        self.to_orthogonalize.append((chunk, slot, work, held))
        while len(self.to_orthogonalize) > 1:
            self._orthogonalize_oldest()
        while len(self.to_apply) > 1:
            self._apply_oldest()

    def advance(self) -> None:
        """One stage of the oldest chunk in flight (called after each AdamW chunk)."""
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
        chunk, slot, work, held = self.to_orthogonalize.popleft()
        self._wait(work)
        self.r.orthogonalize(chunk, slot, self.ctx)
        back = self.r.o.exchange.backward(slot, self.r.o.plans[chunk.index])
        self.to_apply.append((chunk, slot, back, held))

    def _apply_oldest(self) -> None:
        chunk, slot, work, held = self.to_apply.popleft()
        self._wait(work)
        self.r.apply(chunk, slot, self.ctx, held)
