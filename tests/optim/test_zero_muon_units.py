"""ZeroMuon's parts in isolation: the Muon rule, the math against torch's own functions,
owners, the state layout, and the errors a user can meet. One process, no store I/O
beyond a few buckets."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns

from offload_engine.optim import ZeroMuon, default_use_muon
from offload_engine.optim.adamw_math import adamw_update_
from offload_engine.optim.muon_math import NewtonSchulz, adjusted_lr
from offload_engine.optim.owners import ns_flops
from offload_engine.optim.owners import assign_owners
from offload_engine.optim.params import ParamInfo
from offload_engine.optim.state_layout import build_layout
from helpers.zero_muon_harness import MIXED_SHAPES, make_pair, set_grads
from helpers.paths import FIXTURES


# -- the rule -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name, shape, muon", [
    ("layers.0.attn.wq.weight", (8, 8), True),
    ("layers.0.mlp.up.bias", (8,), False),
    ("model.embed_tokens.weight", (100, 8), False),
    ("transformer.wte.weight", (100, 8), False),
    ("transformer.wpe.weight", (100, 8), False),
    ("lm_head.weight", (100, 8), False),
    ("model.lm_head.weight", (100, 8), False),
    ("output.weight", (100, 8), False),             # Llama's top-level head
    ("_orig_mod.output.weight", (100, 8), False),   # torch.compile prefix
    ("encoder.layer.0.output.dense.weight", (8, 8), True),  # BERT: not a head
    ("head.weight", (10, 8), False),
    ("blocks.0.norm.weight", (8,), False),
    ("conv.weight", (4, 3, 3, 3), False),
    (None, (8, 8), True),
    ("scale", (), False),
])
def test_default_use_muon(name, shape, muon):
    assert default_use_muon(name, torch.empty(shape)) is muon


def test_groups_are_split_by_the_rule_and_keep_names():
    model, _ = make_pair(MIXED_SHAPES, None)
    with ZeroMuon(model.named_parameters()) as opt:
        assert [g["use_muon"] for g in opt.param_groups] == [True, False]
        muon_names = opt.param_groups[0]["param_names"]
        assert muon_names == [n for n, p in model.named_parameters() if default_use_muon(n, p)]
        g = opt.param_groups[0]
        assert (g["lr"], g["weight_decay"], g["momentum"], g["nesterov"], g["eps"], g["ns_steps"],
                g["adjust_lr_fn"], g["ns_coefficients"]) == (
            1e-3, 0.1, 0.95, True, 1e-7, 5, None, (3.4445, -4.775, 2.0315))
        a = opt.param_groups[1]
        assert (a["lr"], a["betas"], a["eps"], a["weight_decay"], a["amsgrad"]) == (
            1e-3, (0.9, 0.999), 1e-8, 1e-2, False)


def test_explicit_groups_and_errors():
    w, b = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))
    with ZeroMuon([{"params": [w], "use_muon": True, "lr": 0.5},
                   {"params": [b], "use_muon": False, "betas": (0.5, 0.6)}]) as opt:
        assert opt.param_groups[0]["lr"] == 0.5 and opt.param_groups[1]["betas"] == (0.5, 0.6)
        with pytest.raises(NotImplementedError):
            opt.add_param_group({"params": [nn.Parameter(torch.randn(2, 2))], "use_muon": True})
    with pytest.raises(ValueError, match="Muon only supports 2D"):
        ZeroMuon([{"params": [b], "use_muon": True}])
    with pytest.raises(ValueError, match="Adjust learning rate function"):
        ZeroMuon([w], adjust_lr_fn="spectral")
    with pytest.raises(ValueError, match="unknown AdamW option"):
        ZeroMuon([w], adamw={"betaz": (0.9, 0.9)})
    with pytest.raises(ValueError, match="foreach=True is not supported"):
        ZeroMuon([{"params": [b], "use_muon": False, "foreach": True}])
    with pytest.raises(ValueError, match="Invalid beta"):
        ZeroMuon([b], adamw={"betas": (1.0, 0.9)})


# -- math -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 1), (1, 50), (50, 1), (5, 3), (3, 5), (64, 64), (130, 70), (70, 130)])
@pytest.mark.parametrize("steps", [0, 1, 5])
def test_newton_schulz_equals_torch_bitwise(shape, steps):
    ns = NewtonSchulz(200 * 200, 200)
    coeffs = (3.4445, -4.775, 2.0315)
    for dtype in (torch.float32, torch.bfloat16):
        u = torch.randn(shape).to(dtype)
        want = torch_ns(u.clone(), coeffs, steps, 1e-7)
        ns.input(*shape).copy_(u)
        got = ns.run(*shape, coeffs, steps, 1e-7)
        assert got.shape == want.shape and torch.equal(got, want)


def test_newton_schulz_never_touches_its_input():
    """torch's .bfloat16() aliases a bf16 input and normalizes it in place; we copy."""
    u = torch.randn(6, 4).bfloat16()
    keep = u.clone()
    ns = NewtonSchulz(24, 4)
    ns.input(6, 4).copy_(u)
    ns.run(6, 4, (3.4445, -4.775, 2.0315), 5, 1e-7)
    assert torch.equal(u, keep)
    with pytest.raises(ValueError, match="does not fit"):
        ns.input(10, 10)


def test_adjusted_lr_matches_torch():
    from torch.optim._muon import _adjust_lr
    for shape in [(3, 7), (7, 3), (1, 33), (64, 64)]:
        for fn in (None, "original", "match_rms_adamw"):
            assert adjusted_lr(0.02, fn, shape) == _adjust_lr(0.02, fn, torch.Size(shape))


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
def test_adamw_pieces_equal_torch_single_tensor(amsgrad, maximize):
    torch.manual_seed(0)
    p = torch.randn(1000)
    q = p.clone().requires_grad_()
    ref = torch.optim.AdamW([q], lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1,
                            amsgrad=amsgrad, maximize=maximize)
    m, v, vmax, denom = (torch.zeros(1000) for _ in range(4))
    for step in range(1, 4):
        g = torch.randn(1000)
        q.grad = g.clone()
        ref.step()
        for lo, hi in ((0, 333), (333, 334), (334, 1000)):       # pieces, as store buckets cut them
            adamw_update_(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], vmax[lo:hi], denom[:hi - lo],
                          step=float(step), lr=3e-3, beta1=0.8, beta2=0.95, eps=1e-6,
                          weight_decay=0.1, amsgrad=amsgrad, maximize=maximize)
        st = ref.state[q]
        assert torch.equal(p, q.detach()) and torch.equal(m, st["exp_avg"]) and torch.equal(v, st["exp_avg_sq"])


# -- owners and layout ---------------------------------------------------------------------------------
def test_owners_are_deterministic_and_balanced():
    shapes = [[(64, 64), (64, 64), (32, 128), (8, 8)], [(256, 64)], [(16, 16)] * 6]
    a = assign_owners(shapes, 4)
    assert a == assign_owners(shapes, 4)
    assert a[0][:2] != [a[0][0]] * 2           # the two big ones go to different ranks
    loads = [0] * 4
    for chunk, owners in zip(shapes, a):
        for s, o in zip(chunk, owners):
            loads[o] += ns_flops(*s)
    biggest = max(ns_flops(*s) for c in shapes for s in c)
    assert max(loads) - min(loads) <= biggest
    assert assign_owners([[(4, 4)] * 3], 1) == [[0, 0, 0]]


@pytest.mark.parametrize("mixed", [False, True])
def test_layout_packs_state_without_gaps_and_covers_every_element(mixed):
    """Each array is its chunks' states back to back: every element belongs to exactly one
    parameter, a parameter's state is contiguous at ``starts + offsets``, and a row's
    segments sit at the same place in every array of the chunk. Padding appears only where
    a chunk's arrays disagree on the position inside a bucket (``mixed``: masters for some
    parameters, amsgrad for some), less than one bucket per array each time."""
    world, bucket = 3, 4096
    be = bucket // 4
    infos = []
    for i, (name, shape) in enumerate(MIXED_SHAPES.items()):
        p = torch.empty(shape)
        info = ParamInfo(i, p, {"amsgrad": False}, name, "muon" if default_use_muon(name, p) else "adamw",
                         tuple(shape), torch.float32, True)
        assert info.row_numel == (int(torch.tensor(shape[1:]).prod()) if len(shape) > 1 else 1)
        info.rows_per_rank = [len(c) for c in torch.arange(shape[0]).chunk(world)] + [0] * world
        info.rows_per_rank = info.rows_per_rank[:world]
        infos.append(info)
    master_for = (lambda i: i.name not in ("w_big", "bias")) if mixed else (lambda i: False)
    amsgrad_of = (lambda i: i.name == "bias") if mixed else (lambda i: False)
    for rank in range(world):
        lay = build_layout(infos, rank, bucket, master_for=master_for,
                           state_dtype_of=lambda i: torch.float32, amsgrad_of=amsgrad_of)
        owner = {name: [None] * numel for name, (_, numel) in lay.arrays.items()}
        users: dict = {}
        for c in lay.bundles:
            assert not c.local_numel or len({c.starts[n] % be for n in c.starts}) == 1
            for p in c.params:
                for n in c.arrays:
                    lo = c.starts[n] + c.offsets[p]
                    for e in range(lo, lo + c.sizes[p]):
                        assert owner[n][e] is None
                        owner[n][e] = p
                covered = sorted((s.lo, s.hi) for _, s in lay.param_pieces(p))
                assert sum(hi - lo for lo, hi in covered) == c.sizes[p] == infos[p].local_numel(rank)
                assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
            for row in c.rows:
                for seg in row.segments:
                    assert seg.offset + seg.hi - seg.lo <= be
                    for n, b in row.buckets.items():   # the same place in every array
                        assert b * be + seg.offset == c.starts[n] + c.offsets[seg.param] + seg.lo
                for key in row.buckets.items():
                    users.setdefault(key, set()).add(c.index)
        # no gaps but the alignment padding, and that is under a bucket per array and change
        for n, o in owner.items():
            assert o.count(None) == lay.padding.get(n, 0) < 3 * be
        if not mixed:
            assert lay.padding == {} and lay.padding_bytes() == 0
        # a bucket shared by chunks is used by each of their rows in it, once per step
        uses = lay.uses()
        assert all(uses[k] >= len(u) for k, u in users.items())
        assert sorted(lay.step_order(False)) == sorted(lay.step_order(True)) == sorted(users)
        kinds = [c.kind for c in lay.bundles]
        assert set(kinds) == {"muon", "adamw"}


@pytest.mark.parametrize("master", [False, True])
def test_a_step_runs_the_schedule_the_planner_replays(master):
    """A real step (both walking directions, some parameters without a gradient) makes
    exactly the store calls of ``step_schedule`` (what plan/step_sim replays), writes back
    clean the buckets of rows without a gradient, and the store's schedule is each
    direction's order of first use."""
    from offload_engine.optim.step_schedule import store_calls
    model, ref = make_pair(MIXED_SHAPES, None)
    if master:
        model.to(torch.bfloat16)
    store = {"default_home": "cpu", "bucket_bytes": 4096, "cpu_budget": 64 * 4096}
    with ZeroMuon(model.named_parameters(), lr=0.02, master_weights=master, store=store,
                  adamw={"amsgrad": True}) as opt:
        lay = opt.layout
        assert any(n > 1 for n in lay.uses().values()), "the case should share a bucket"
        calls, cleans = [], []
        acquire, release = opt.store.acquire, opt.store.release

        def rec_acquire(name, rng, device="cpu"):
            h = acquire(name, rng, device)
            calls.append(("acquire", (name, rng)))
            return h

        def rec_release(h, dirty=False):
            calls.append(("release", (h.array, h._bucket.index)))
            cleans.append(not dirty)
            release(h, dirty)

        orders = []
        begin_step = opt.store.begin_step

        def rec_begin_step():
            orders.append(begin_step())
            return orders[-1]

        opt.store.acquire, opt.store.release = rec_acquire, rec_release
        opt.store.begin_step = rec_begin_step
        for step in range(4):
            set_grads(model, ref, step, 0, 1)
            # step 2: no Muon gradient (its rows go back clean); step 3: every other AdamW one
            adamw = sorted(i.index for i in opt.infos if i.kind == "adamw")
            idle = ({i.index for i in opt.infos if i.kind == "muon"} if step == 2
                    else set(adamw[::2]) if step == 3 else set())
            for i in opt.infos:
                if i.index in idle:
                    i.param.grad = None
            active = {i.index for i in opt.infos} - idle
            calls.clear()
            cleans.clear()
            opt.step()
            reverse = step % 2 == 1
            assert calls == store_calls(lay, reverse, active), step
            assert orders[-1] == opt._orders[reverse]  # the store's order for this step
            if not idle:
                first = list(dict.fromkeys(k for kind, k in calls if kind == "acquire"))
                assert first == lay.step_order(reverse)
                assert not any(cleans)
            elif step == 2:
                assert any(cleans), "rows without a gradient go back clean"


@pytest.mark.parametrize("world", [1, 8])
def test_llama_state_has_no_bucket_padding(world):
    """At 64 MiB buckets the old layout (every chunk on a bucket boundary) padded Llama-2-7B's
    state by 5-24%; packed, the only padding is where Muon and AdamW master chunks meet in
    the master array (under one bucket per array)."""
    import os
    from offload_engine.plan.memory import PlanOptions, classify, rank_states
    from offload_engine.plan.model_shapes import load_model
    model = load_model(os.path.join(FIXTURES, "hf_configs", "llama-7b.json"))
    for master in (False, True):
        st = rank_states(model, PlanOptions(world_size=world, gpus_per_node=world,
                                            master_weights=master), kinds=classify(model))[0]
        lay = st.layout
        logical = sum(c.local_numel * st.arrays[n].itemsize for c in lay.bundles for n in c.arrays)
        assert lay.state_bytes() == logical + lay.padding_bytes()
        assert lay.padding_bytes() <= len(lay.arrays) * lay.bucket_bytes
        if not master:
            assert lay.padding_bytes() == 0


# -- store handling ------------------------------------------------------------------------------------
@pytest.mark.parametrize("alternate", [True, False])
def test_the_store_owns_the_step_order_zero_muon_declares_it_once(tmp_path, alternate):
    """ZeroMuon declares both walking orders at construction and never again; each step
    it walks the direction the store chose (alternating with ``alternate_order``)."""
    from offload_engine.store import TieredStore
    model, ref = make_pair(MIXED_SHAPES, None)
    store = TieredStore({"nvme_paths": [str(tmp_path)], "bucket_bytes": 4096,
                         "cpu_budget": 6 * 4096, "prefetch_depth": 1,
                         "alternate_order": alternate})
    declared, firsts = [], []
    set_schedule, acquire = store.set_schedule, store.acquire

    def rec_set_schedule(*args, **kwargs):
        declared.append(args)
        return set_schedule(*args, **kwargs)

    def rec_acquire(name, rng, device="cpu"):
        firsts.append((name, rng))
        return acquire(name, rng, device)

    store.set_schedule, store.acquire = rec_set_schedule, rec_acquire
    with store, ZeroMuon(model.named_parameters(), store=store) as opt:
        assert len(declared) == 1                         # at construction: both orders
        assert [list(o) for o in declared[0]] == [opt._orders[False], opt._orders[True]]
        assert opt._orders[True] != opt._orders[False][::-1], "the case should share buckets"
        for step in range(4):
            set_grads(model, ref, step, 0, 1)
            firsts.clear()
            opt.step()
            backward = alternate and step % 2 == 1
            assert store.step_is_backward is backward
            assert list(dict.fromkeys(firsts)) == opt._orders[backward], step
        assert len(declared) == 1, "ZeroMuon re-declared the store's schedule"


def test_budget_too_small_and_stale_directory_are_clear_errors(tmp_path):
    model, ref = make_pair(MIXED_SHAPES, None)
    with pytest.raises(ValueError, match="cpu_budget .* too small"):
        ZeroMuon(model.named_parameters(), store={"default_home": "cpu", "cpu_budget": 4096,
                                                  "bucket_bytes": 4096})
    cfg = {"nvme_paths": [str(tmp_path)], "bucket_bytes": 4096, "cpu_budget": 8 * 4096}
    with ZeroMuon(model.named_parameters(), store=cfg) as opt:
        set_grads(model, ref, 0, 0, 1)
        opt.step()
    assert (tmp_path / "rank0" / "muon_momentum" / "zarr.json").exists()  # one level per rank
    with pytest.raises(ValueError, match="earlier run") as info:
        ZeroMuon(model.named_parameters(), store=cfg)
    msg = str(info.value)
    assert str(tmp_path / "rank0") in msg and "load_checkpoint" in msg and "stale_store" in msg


def test_parameters_without_gradients_are_skipped_like_torch():
    model, ref = make_pair(MIXED_SHAPES, None)
    from helpers.zero_muon_harness import assert_parity, reference_optimizers
    with ZeroMuon(model.named_parameters(), lr=0.02) as opt:
        ref_opts = reference_optimizers(ref, dict(lr=0.02), {})
        for step in range(3):
            set_grads(model, ref, step, 0, 1)
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                if (n in ("w_odd", "bias")) != (step == 2):   # absent, then present
                    p.grad = q.grad = None
            opt.step()
            for o in ref_opts:
                o.step()
            assert_parity(opt, model, ref, ref_opts, 0, 1, f"step {step}")


def test_bf16_parameters_state_bitwise_params_within_one_rounding():
    """bf16 params keep bf16 state, as torch's (zeros_like(grad)); with nesterov=True (torch's
    nesterov=False aliases and corrupts a bf16 momentum buffer, pytorch#194664) the states
    agree bit for bit. The last op, ``param.add_(O, alpha)``, rounds once in torch's
    vectorized kernel but twice in its scalar fallback (taken when O is a transposed view,
    i.e. for tall matrices, and in loop tails), so a parameter element may differ by one
    bf16 rounding; each step is checked from equal parameters."""
    from helpers.zero_muon_harness import assert_parity, reference_optimizers
    model, ref = make_pair(MIXED_SHAPES, None)
    model.to(torch.bfloat16)
    ref.to(torch.bfloat16)
    with ZeroMuon(model.named_parameters(), lr=0.02) as opt:
        ref_opts = reference_optimizers(ref, dict(lr=0.02), {})
        for step in range(3):
            set_grads(model, ref, step, 0, 1)
            before = {n: p.detach().float().abs() for n, p in model.named_parameters()}
            opt.step()
            for o in ref_opts:
                o.step()
            with torch.no_grad():
                for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                    # a + round(alpha * o) vs round(a + alpha * o): within an ulp of the larger
                    big = torch.maximum(torch.maximum(p.float().abs(), q.float().abs()), before[n])
                    ulp = torch.exp2(torch.floor(torch.log2(big.clamp(min=1e-30))) - 7)
                    assert ((p.float() - q.float()).abs() <= ulp).all(), n
                    if n in ("w_wide", "w_row", "w_short", "embed_tokens", "bias"):
                        assert torch.equal(p, q), n       # wide or AdamW: one rounding in both
                    p.copy_(q)
            assert_parity(opt, model, ref, ref_opts, 0, 1, f"bf16 step {step}")
        assert opt.layout.arrays.keys() >= {"muon_momentum_bfloat16", "adam_exp_avg_bfloat16"}


def test_master_weights_equal_an_fp32_run_rounded(tmp_path):
    """bf16 params + fp32 masters: the masters follow torch's fp32 math on the upcast bf16
    gradients exactly, and the bf16 params are the masters rounded."""
    from helpers.zero_muon_harness import reference_optimizers
    model, ref = make_pair(MIXED_SHAPES, None)
    model.to(torch.bfloat16)
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})  # masters start here
    # masters of three Muon chunks in flight stay pinned: w_big's alone is 6 buckets
    cfg = {"nvme_paths": [str(tmp_path)], "bucket_bytes": 4096, "cpu_budget": 21 * 4096}
    with ZeroMuon(model.named_parameters(), lr=0.02, master_weights=True, store=cfg) as opt:
        ref_opts = reference_optimizers(ref, dict(lr=0.02), {})
        for step in range(3):
            set_grads(model, ref, step, 0, 1)
            for p, q in zip(model.parameters(), ref.parameters()):
                q.grad = p.grad.float()
            opt.step()
            for o in ref_opts:
                o.step()
            sd = opt.state_dict()
            for info, (n, q) in zip(opt.infos, ((n, dict(ref.named_parameters())[n]) for n in
                                                 (i.name for i in opt.infos))):
                assert torch.equal(sd["state"][info.index]["master_param"], q.detach()), n
                assert torch.equal(info.param.detach(), q.detach().bfloat16()), n
