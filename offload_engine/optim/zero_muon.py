"""ZeroMuon: torch.optim.Muon for matrices and torch.optim.AdamW for the rest, ZeRO-3 style.

Parameters are DTensors on a 1-D or 2-D device mesh (FSDP2's ``Shard(0)``, HSDP, FSDP +
tensor parallel, replicated: each rank holds one box of each parameter) or plain tensors.
Optimizer state (Muon momentum, Adam moments, optionally fp32 masters) lives in a
per-rank TieredStore (GPU, pinned CPU or NVMe), never in Python-held tensors. Each step
reads and writes every state bucket once, prefetched ahead of compute; a Muon matrix's
Nesterov input travels as bf16 to one owner rank, which runs Newton-Schulz, and the result
travels back (two all_to_alls per bundle; momentum is never gathered). Results equal
torch.optim.Muon / torch.optim.AdamW run on the unsharded model, bit for bit, on CPU.

See docs/optimizer.md.
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.distributed as dist

from ..io import syscalls
from ..layout.manifest import SHARDS
from ..store import StoreConfig, TieredStore
from ..store.geometry import array_pool_bytes
from ..units import PAGE
from .close_callbacks import CLOSE_CALLBACKS
from .comm import Exchange, plan_exchange, plan_matrices
from .experts import report_non_matrices, with_experts
from .groups import ADAMW_DEFAULTS, MUON_DEFAULTS, fill_defaults, iter_named, split_groups
from .muon_defaults import DEFAULT_EPS, DEFAULT_NS_COEFFICIENTS, DEFAULT_NS_STEPS
from .muon_math import NewtonSchulz
from .owners import assign_owners
from .param_names import module_aware, name_params
from .param_rules import default_use_muon
from .params import ParamInfo
from .pipeline import StepContext, StepRunner
from .pool_budget import kept_tails, pool_use, working_buckets
from .resources import Scratch, StepResources
from .sharding import check_grad, describe, exchange_group, flat_local, is_dtensor, local_tensor
from .state_io import load_state, read_state
from .optimizer_state import OptimizerState
from .state_layout import build_layout
from .state_view import StateView
from .step_schedule import SLOTS, step_schedule
from .step_stats import StepStats
from .store_dir import STALE_STORE_CHOICES, array_home, rank_store_config, stale_store_message
from .store_manifest import store_manifest
from ..errors import InputError, UsageError

log = logging.getLogger(__name__)


class ZeroMuon(torch.optim.Optimizer):
    """Muon (2-D hidden matrices) + AdamW (everything else) with state in a TieredStore.

    Args:
        params: tensors, ``(name, tensor)`` pairs (e.g. ``model.named_parameters()``), or
            group dicts. A group with ``use_muon`` True takes Muon options, False AdamW
            options; a group without it is split by ``use_muon_rule``.
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn:
            Muon defaults, exactly those of ``torch.optim.Muon`` (torch 2.13).
        adamw: AdamW defaults overriding those of ``torch.optim.AdamW`` (``lr=1e-3,
            betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, maximize=False``).
        store: a store config (dict or StoreConfig) from which each rank opens its own
            TieredStore (``nvme_paths`` get a ``rank{r}`` subfolder, which holds that
            rank's arrays), an open TieredStore (yours to close), or None: state in pinned
            CPU memory, sized to fit.
        master_weights: keep fp32 master copies of non-fp32 parameters in the store and run
            the math (and keep the state) in fp32; the parameter gets the rounded result.
        use_muon_rule: ``f(name, param) -> bool`` for groups without ``use_muon``. A 3-D
            parameter it puts on Muon is a stack of matrices along dim 0 (one per expert).
        expert_params: 3-D parameters that are stacks of expert matrices ``[num_experts,
            out, in]`` besides those the default rule knows (a module named ``experts``): a
            regular expression searched in the name, or ``f(name, param) -> bool``. Each
            expert is its own matrix to Muon (docs/optimizer.md, Mixture of experts).
        model: the model the parameters belong to, for parameters or groups passed without
            names (``model.parameters()``, the Hugging Face Trainer's groups): each gets its
            name from the model, and embedding tables and output heads (by module:
            ``nn.Embedding``, ``get_input/output_embeddings()``) stay on AdamW whatever their
            names. Without it, unnamed 2-D parameters go to Muon with a warning.
        stale_store: what to do when a rank's store folder holds state an earlier run left
            there (a crashed run's): ``"refuse"`` (the default: a ValueError naming the
            folder and how to resume) or ``"discard"``: remove it, and start from zero state
            as a new run does. Resuming a run into its old store directory is
            ``stale_store="discard"`` followed by ``load_checkpoint``; the old store's bytes
            are never read. A store another process has open is refused either way.
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
                 eps: float = DEFAULT_EPS, ns_steps: int = DEFAULT_NS_STEPS,
                 adjust_lr_fn: str | None = None, *, adamw: dict | None = None,
                 store: StoreConfig | dict | TieredStore | None = None,
                 master_weights: bool = False, use_muon_rule=default_use_muon,
                 model: torch.nn.Module | None = None, stale_store: str = "refuse",
                 expert_params=None):
        self._ready = False
        if stale_store not in STALE_STORE_CHOICES:
            raise InputError(f"stale_store must be one of {STALE_STORE_CHOICES}, got "
                             f"{stale_store!r}")
        self._stale_store = stale_store
        self._muon_defaults = dict(MUON_DEFAULTS, lr=lr, weight_decay=weight_decay,
                                   momentum=momentum, nesterov=nesterov,
                                   ns_coefficients=tuple(ns_coefficients), eps=eps,
                                   ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        unknown = set(adamw or {}) - set(ADAMW_DEFAULTS)
        if unknown:
            raise InputError(f"unknown AdamW option(s) {sorted(unknown)}")
        self._adamw_defaults = dict(ADAMW_DEFAULTS, **(adamw or {}))
        rule, report_guesses = module_aware(with_experts(use_muon_rule, expert_params), model)
        super().__init__(split_groups(name_params(params, model), rule), {})
        report_guesses()
        self.defaults = dict(self._muon_defaults)
        self.master_weights = master_weights
        self._build(store)
        self._ready = True

    def add_param_group(self, param_group: dict) -> None:
        if self._ready:
            raise NotImplementedError("ZeroMuon lays out its state once: pass every parameter "
                                      "group to the constructor")
        if "use_muon" not in param_group:
            raise InputError("a ZeroMuon parameter group needs use_muon=True or False")
        fill_defaults(param_group, self._muon_defaults, self._adamw_defaults)
        super().add_param_group(param_group)

    # -- construction ------------------------------------------------------------------------------
    def _build(self, store) -> None:
        infos: list[ParamInfo] = []
        for group in self.param_groups:
            kind = "muon" if group["use_muon"] else "adamw"
            for name, p in iter_named(group):
                if kind == "muon" and p.ndim not in (2, 3):
                    raise InputError("Muon only supports 2D parameters (and 3-D stacks of "
                                     "expert matrices) whereas we found a parameter with "
                                     f"size: {p.size()}" + (f" ({name})" if name else ""))
                if not p.is_floating_point():
                    raise InputError(f"parameter {name or len(infos)} has dtype {p.dtype}; "
                                     "only floating point parameters can be optimized")
                infos.append(ParamInfo(len(infos), p, group, name, kind, tuple(p.shape),
                                       p.dtype, is_dtensor(p)))
        report_non_matrices(infos)
        devices = {local_tensor(i.param).device for i in infos}
        if len(devices) != 1:
            raise InputError(f"all parameters must be on one device, found {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.infos = infos
        self.group = exchange_group(infos)
        if self.group is not None:
            self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        else:
            self.world, self.rank = 1, 0
        self.store_rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        # a rank's store is its own folder: its arrays go by their layout names
        self.prefix = ""

        cfg = self._store_config(store)
        describe(infos, self.group, self.world, self.rank,
                 [int(cfg.alternate_order), int(self.master_weights), cfg.bucket_bytes])
        master_for = lambda i: self.master_weights and i.dtype != torch.float32
        self.layout = build_layout(
            infos, self.rank, cfg.bucket_bytes, master_for=master_for,
            state_dtype_of=lambda i: torch.float32 if master_for(i) else i.dtype,
            amsgrad_of=lambda i: i.kind == "adamw" and bool(i.group["amsgrad"]))
        # each walking direction's order of first use; not mirror images of each other,
        # since a bucket two bundles share is first used where the walk meets it first
        self._orders = {rev: [(self.array_name(n), b) for n, b in self.layout.step_order(rev)]
                        for rev in (False, True)}
        self._open_store(store, cfg)

        self.resources = self._step_resources()
        self._order_warned = False
        self._runner = StepRunner(self.resources)
        self.last_step_stats: StepStats | None = None
        self._steps_done = 0

    def _step_resources(self) -> StepResources:
        """The owners of the Muon matrices, each bundle's exchange plan, and every buffer a
        step uses, allocated once for the largest bundle, matrix and segment."""
        infos = self.infos
        muon = [c for c in self.layout.bundles if c.kind == "muon"]
        spread = lambda c: c.distributed and self.world > 1
        mats = {c.index: plan_matrices([infos[p] for p in c.params], self.world, spread(c))
                for c in muon}
        exchanged = [c for c in muon if spread(c)]
        owners = assign_owners([[(m.rows, m.cols) for m in mats[c.index]] for c in exchanged],
                               self.world, candidates=[[m.candidates for m in mats[c.index]]
                                                       for c in exchanged])
        owner_of = {c.index: o for c, o in zip(exchanged, owners)}
        plans = {c.index: plan_exchange([infos[p] for p in c.params],
                                        owner_of.get(c.index, [self.rank] * len(mats[c.index])),
                                        self.rank, self.world, c.distributed)
                 for c in muon}
        most = lambda f: max((f(pl) for pl in plans.values() if not pl.local), default=0)
        exchange = Exchange(self.group, self.rank, self.world, SLOTS,
                            max((pl.send_total for pl in plans.values()), default=0),
                            most(lambda pl: pl.recv_numel), device=self.device,
                            max_back_send=most(lambda pl: pl.back_send_numel),
                            max_back_recv=most(lambda pl: pl.back_recv_numel))
        owned = [m for pl in plans.values() for m in pl.owned + pl.kept]
        ns = NewtonSchulz(max((m.rows * m.cols for m in owned), default=0),
                          max((min(m.rows, m.cols) for m in owned), default=0), self.device)
        longest = max((s.hi - s.lo for c in self.layout.bundles for r in c.rows
                       for s in r.segments), default=0)
        matrix_owner = {(m.param, m.expert): o for c in exchanged
                        for m, o in zip(mats[c.index], owner_of[c.index])}
        return StepResources(self.store, self.layout, infos, plans, exchange, ns,
                             Scratch(longest, self.device), self.device, self.prefix,
                             {p: o for (p, e), o in matrix_owner.items()
                              if not infos[p].stacked}, matrix_owner)

    # what a step uses, by name, for callers that inspect it (tests, benchmarks)
    plans = property(lambda self: self.resources.plans)
    exchange = property(lambda self: self.resources.exchange)
    ns = property(lambda self: self.resources.ns)
    owner = property(lambda self: self.resources.owner)
    matrix_owner = property(lambda self: self.resources.matrix_owner)

    def _store_config(self, store) -> StoreConfig:
        if isinstance(store, TieredStore):
            return store.config
        if store is None:
            return StoreConfig.load({"default_home": "cpu"})
        cfg = store if isinstance(store, StoreConfig) else StoreConfig.load(dict(store))
        return rank_store_config(cfg, self.store_rank)

    def _open_store(self, store, cfg: StoreConfig) -> None:
        # pinned bytes of all state resident at once (each bucket page-rounded, as the pool takes it)
        needed = sum(array_pool_bytes(a.numel, a.dtype, cfg.bucket_bytes)
                     for a in self.layout.arrays.values())
        if store is None:
            cfg = StoreConfig.load({**cfg.model_dump(exclude_unset=True), "cpu_budget": max(needed, PAGE)})
        if self.device.type == "cuda" and not isinstance(store, TieredStore) and cfg.gpu_budget == 0:
            # the step acquires buckets on the parameters' device: the store stages them there.
            # A config without a gpu_budget (0, the default) gets what the step holds at once
            staging = working_buckets(self.layout) * cfg.bucket_bytes
            log.info("ZeroMuon: parameters on %s and no gpu_budget given: %d bytes of GPU "
                        "memory stage the buckets a step holds", self.device, staging)
            cfg = StoreConfig.load({**cfg.model_dump(exclude_unset=True), "gpu_budget": staging})
        self._own_store = not isinstance(store, TieredStore)
        self._pinned: list = []
        # the state (store handle, lazy tensors, step counts) is one object the optimizer owns
        self.optimizer_state = OptimizerState(
            TieredStore(cfg) if self._own_store else store,  # the lock is held from here
            self.layout, self.infos, self.rank, self.device, self.array_name)
        if self._own_store:
            try:
                self._handle_earlier_run()
            except BaseException:
                self.store.close()
                raise
        try:
            spare = self._check_budget(cfg, needed)
            homes = {}
            for name, a in self.layout.arrays.items():
                homes[name] = self.store.register(self.array_name(name), a.dtype.torch, a.numel,
                                                  home=self._home_of(cfg, name)).home
            # short last buckets of NVMe arrays stay acquired when the pool has room for them
            for n, b in kept_tails(self.layout, homes, spare):
                self._pinned.append(self.store.keep(self.array_name(n), b))
            # declared once: from now on the store owns the step order (and its alternation)
            self.store.set_schedule(self._orders[False], self._orders[True])
            if self.store.root is not None:
                tensors, shards = store_manifest(self)
                self.store.update_manifest({**tensors, SHARDS: shards})  # one atomic write
        except Exception:
            self._release_pinned()
            if self._own_store:
                try:
                    self.store.close()
                except Exception:  # the error that matters is the one being raised
                    pass
                self._remove_new_arrays(cfg)
            raise

    def _handle_earlier_run(self) -> None:
        """Refuse or discard (``stale_store``) the state an earlier run left in the store
        folder; the store holds its lock, so that run is not alive."""
        earlier = self.store.earlier_run([self.array_name(n) for n in self.layout.arrays])
        if earlier is None:
            return
        if self._stale_store != "discard" and earlier.arrays:
            raise InputError(stale_store_message(earlier.root, earlier.describe()))
        if earlier.arrays:
            log.warning("ZeroMuon: discarding the state an earlier run left in %s (%s); "
                        "load a checkpoint to resume it", earlier.root, earlier.describe())
        self.store.discard_earlier_run(earlier)

    def _home_of(self, cfg: StoreConfig, name: str) -> str:
        """Home tier of layout array ``name`` (``homes`` keys of either naming match)."""
        return array_home(cfg, self.array_name(name), self.store_rank)

    def _remove_new_arrays(self, cfg: StoreConfig) -> None:
        """After a failed construction (a full disk while registering, say): remove the
        state arrays it created, which hold nothing yet, so that a second attempt on the
        same directory is not refused as "state from an earlier run". None existed before
        (``_open_store`` checked), so everything there is this construction's."""
        for p in cfg.nvme_paths:
            for name in self.layout.arrays:
                path = os.path.join(p, self.prefix + name)
                if os.path.isdir(path):
                    try:
                        syscalls.rmtree(path)
                    except OSError:
                        pass  # best effort: the error that matters is the one being raised

    def _check_budget(self, cfg: StoreConfig, total: int) -> int:
        """Raise if the pool cannot hold what a step needs; return the bytes left over."""
        homes = {n: self._home_of(cfg, n) for n in self.layout.arrays}
        if "auto" in homes.values():
            return 0  # the store decides; it keeps working room itself
        use = pool_use(self.layout, homes, cfg.cpu_budget)
        if use.spare < 0:
            raise InputError(f"store cpu_budget {cfg.cpu_budget} bytes is too small: the state "
                             f"homed on cpu needs {use.pinned} bytes and the step's working set "
                             f"on nvme about {use.work} more ({total} bytes of state in all)")
        return use.spare

    def _check_params_kept(self) -> None:
        """The parameters in param_groups are the ones the state was laid out for. A
        wrapper that swaps them afterwards (accelerate's FSDP2 preparation puts the sharded
        DTensors into an existing optimizer's groups) would otherwise leave the step
        updating tensors the model no longer uses."""
        current = {id(p) for g in self.param_groups for p in g["params"]}
        if current != {id(i.param) for i in self.infos}:
            raise UsageError(
                "ZeroMuon: param_groups hold other parameters than those it was built with "
                "(a wrapper replaced them after construction, as accelerate does when it "
                "shards a model with FSDP2 for an optimizer that already exists); build "
                "ZeroMuon after the model is wrapped (docs/optimizer.md, Hugging Face Trainer)")

    def array_name(self, name: str) -> str:
        return self.prefix + name

    # -- the step ----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step: reads and writes each state bucket once."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t0 = time.perf_counter()
        self._check_params_kept()
        state = self.optimizer_state
        state.before_write()  # state dicts taken before keep their values
        self.exchange.reset_counters()
        ns_before = self.ns.calls
        # the store owns the order: this step walks the way it says (alternating with
        # alternate_order), and the bundles go the same way
        order = self.store.begin_step()
        reverse = self.store.step_is_backward
        self._check_order(order, reverse)

        active, params_flat, grads_flat, steps = set(), {}, {}, {}
        for info in self.infos:
            p = info.param
            if p.grad is None:
                continue
            if p.grad.dtype != p.dtype:
                raise InputError(f"parameter {info.name or info.index}: gradient dtype "
                                 f"{p.grad.dtype} differs from the parameter's {p.dtype}")
            check_grad(p, p.grad, f"parameter {info.name or info.index}")
            active.add(info.index)
            params_flat[info.index] = flat_local(p, f"parameter {info.name or info.index}")
            grads_flat[info.index] = flat_local(p.grad, f"gradient of {info.name or info.index}")
            if info.kind == "adamw":
                steps[info.index] = state.advance_step(info)
        ctx = StepContext(reverse, active, state.uninitialized(active), params_flat, grads_flat,
                          steps)
        try:
            # the one order of the step's store calls and stages (the planner replays it)
            self._runner.run(ctx, step_schedule(self.layout, reverse, active))
        except BaseException:
            # an I/O error (a full disk) ended the step part way: the state and parameters
            # are partly updated, as after any failed in-place step, but no bucket stays
            # lent, so the next step, a flush or a close still work (docs/optimizer.md)
            self._runner.give_back(ctx)
            raise
        assert not ctx.lent, "a bucket was not released"
        state.mark_initialized(active)

        st = self.store.stats(reset=True)
        self._steps_done += 1
        self.last_step_stats = StepStats(
            step=self._steps_done, a2a_bytes_sent=self.exchange.bytes_sent,
            a2a_bytes_received=self.exchange.bytes_received, a2a_calls=self.exchange.calls,
            ns_calls=self.ns.calls - ns_before,
            muon_params=sum(1 for i in active if self.infos[i].kind == "muon"),
            adamw_params=len(steps), store_bytes_read=dict(st.bytes_read),
            store_bytes_written=dict(st.bytes_written), store_hits=st.hits,
            store_misses=st.misses, store_io_wait_s=st.io_wait_s,
            step_s=time.perf_counter() - t0, comm_wait_s=ctx.comm_wait_s, ns_s=ctx.ns_s)
        return loss

    def _check_order(self, order, reverse: bool) -> None:
        if order is None or self._order_warned:
            return
        if list(order) != self._orders[reverse]:
            self._order_warned = True
            log.warning("the store's bucket order is not the optimizer's (another user of the "
                        "store?): prefetching will miss; results are unaffected")

    # -- state dict ---------------------------------------------------------------------------------
    @property
    def state(self) -> StateView:
        """torch's ``optimizer.state`` as a read-only view: ``{param: {state key: tensor}}``
        for every parameter with state, values read from the store on use (see state_dict)."""
        return StateView(self.optimizer_state)

    @state.setter
    def state(self, value) -> None:
        # torch.optim.Optimizer.__init__ assigns its empty defaultdict here; the AdamW step
        # counts, the only state held outside the store, are the state object's
        if getattr(self, "optimizer_state", None) is not None:
            raise UsageError("ZeroMuon.state is a read-only view of the state in its store; "
                             "use load_state_dict to change it")

    @property
    def store(self):
        """The TieredStore holding this rank's state (None once ``close`` closed it)."""
        state = getattr(self, "optimizer_state", None)
        return None if state is None else state.store

    def state_dict(self) -> dict:
        """torch's optimizer state dict: per parameter ``momentum_buffer`` (Muon, lerp
        convention) or ``step``/``exp_avg``/``exp_avg_sq`` (AdamW), plus ``master_param`` with
        master weights. DTensor parameters get DTensor state (this rank's rows, Shard(0));
        plain ones plain tensors. The tensors are read from the store when used, one at a
        time (torch.distributed.checkpoint saves them so, in bounded memory), and keep the
        values of this call: a step or a load first reads those still referenced into
        memory (docs/optimizer.md)."""
        return read_state(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what ``state_dict()`` (ours, or torch.optim.Muon/AdamW's for the same
        parameters) returned; full tensors are cut to this rank's rows."""
        load_state(self, state_dict)

    # -- lifetime ----------------------------------------------------------------------------------
    def _release_pinned(self) -> None:
        for h in getattr(self, "_pinned", []):
            self.store.release(h)
        self._pinned = []

    def close(self) -> None:
        """Flush and close the store this optimizer opened (a store passed in stays open),
        and let go of what others hold for it (the writer lock of a checkpoint folder it
        saved into: ``CLOSE_CALLBACKS``)."""
        try:
            if getattr(self, "store", None) is not None:
                self.optimizer_state.before_write()  # state dicts still referenced keep values
                self._release_pinned()
            if getattr(self, "_own_store", False) and self.store is not None:
                store = self.store
                try:
                    if store.root is not None:
                        store.update_manifest({"step": self._steps_done})
                finally:  # a manifest that cannot be written (a full disk) still closes it
                    try:
                        store.close()
                    finally:
                        self.optimizer_state.detach_store()
        finally:
            for release in self.__dict__.pop(CLOSE_CALLBACKS, []):
                release()

    def __enter__(self) -> "ZeroMuon":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
