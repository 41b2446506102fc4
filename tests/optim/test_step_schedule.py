"""The step schedule (optim/step_schedule.py): the one order of a step's store calls and
stages, which the step runner executes and the planner replays. Its properties, on the
layouts the planner builds (pure: no torch), and the replay against a real store."""

from __future__ import annotations

import pytest

from offload_engine.optim.pool_budget import peak_held, working_buckets
from offload_engine.optim.step_schedule import SLOTS, Do, step_schedule, store_calls
from offload_engine.plan.memory import PlanOptions, rank_states
from offload_engine.plan.model_shapes import from_hf_config

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 97, "tie_word_embeddings": False}
BUCKET = 8192


def layouts():
    """(label, layout) of every rank: one and two ranks, with and without fp32 masters,
    buckets small enough that bundles share buckets."""
    model = from_hf_config(TINY_LLAMA, name="tiny-llama")
    out = []
    for world in (1, 2):
        for master in (False, True):
            opts = PlanOptions(world_size=world, gpus_per_node=world, master_weights=master,
                               bucket_bytes=BUCKET, device="cpu", gpu=False)
            for st in rank_states(model, opts):
                out.append((f"W{world}-master{int(master)}-rank{st.rank}", st.layout))
    return out


LAYOUTS = layouts()
IDS = [label for label, _ in LAYOUTS]


def bundle_order(ops):
    return list(dict.fromkeys(op.bundle.index for op in ops))


@pytest.mark.parametrize("label, lay", LAYOUTS, ids=IDS)
@pytest.mark.parametrize("reverse", [False, True])
def test_every_bucket_is_read_and_written_once_per_step(label, lay, reverse):
    """Each row acquires each of its buckets once and releases it once; a shared bucket
    stays acquired from its first use to its last (the store sees one read and one write);
    nothing is held at the end."""
    assert any(n > 1 for n in lay.uses().values()), "the case should share buckets"
    acquired, released, refs = {}, {}, {}
    for op in step_schedule(lay, reverse):
        if op.do is Do.ACQUIRE:
            assert (op.bundle.index, op.row, op.array) not in acquired
            acquired[(op.bundle.index, op.row, op.array)] = True
            refs[op.bucket] = refs.get(op.bucket, 0) + 1
        elif op.do is Do.RELEASE:
            assert acquired.get((op.bundle.index, op.row, op.array)), "released, not acquired"
            assert (op.bundle.index, op.row, op.array) not in released
            released[(op.bundle.index, op.row, op.array)] = True
            refs[op.bucket] -= 1
            if not refs[op.bucket]:
                del refs[op.bucket]
                # the bucket goes back to the store: its users of this step are all done
                users = sum(1 for k in acquired if k[2] == op.array
                            and lay.bundles[k[0]].rows[k[1]].buckets[k[2]] == op.bucket[1])
                assert users == lay.uses()[op.bucket]
    assert not refs
    rows = {(c.index, j, n) for c in lay.bundles for j, r in enumerate(c.rows) for n in r.buckets}
    assert set(acquired) == set(released) == rows
    first = list(dict.fromkeys(op.bucket for op in step_schedule(lay, reverse)
                               if op.do is Do.ACQUIRE))
    assert first == lay.step_order(reverse)  # the store's schedule for this direction


@pytest.mark.parametrize("label, lay", LAYOUTS, ids=IDS)
def test_alternate_steps_walk_the_other_way(label, lay):
    fwd, rev = list(step_schedule(lay, False)), list(step_schedule(lay, True))
    assert bundle_order(rev) == bundle_order(fwd)[::-1]
    for c in lay.bundles:  # and each bundle's rows
        rows = lambda ops: list(dict.fromkeys(o.row for o in ops if o.bundle is c and o.row is not None))
        assert rows(rev) == rows(fwd)[::-1]
    assert sorted(store_calls(lay, False)) == sorted(store_calls(lay, True))


@pytest.mark.parametrize("label, lay", LAYOUTS, ids=IDS)
@pytest.mark.parametrize("reverse", [False, True])
def test_at_most_slots_muon_bundles_are_in_flight(label, lay, reverse):
    """A Muon bundle is in flight from its first pack to its last apply, in its own slot of
    exchange buffers; never more than SLOTS at once, and the pipeline does fill them."""
    flying: dict[int, int] = {}   # bundle -> slot
    most = 0
    stages: dict[int, list] = {}
    for op in step_schedule(lay, reverse):
        if op.slot is None:
            continue
        b = op.bundle.index
        if b not in flying:
            assert op.slot not in flying.values(), "two bundles in one slot"
            flying[b] = op.slot
            most = max(most, len(flying))
        assert flying[b] == op.slot
        stages.setdefault(b, []).append(op.do)
        if op.do is Do.APPLY and op.row == (0 if reverse else len(op.bundle.rows) - 1):
            del flying[b]
        elif op.do is Do.RECEIVE and not op.bundle.rows:
            del flying[b]
    assert most <= SLOTS
    muon = [c for c in lay.bundles if c.kind == "muon"]
    if len(muon) >= SLOTS:
        assert most == SLOTS
    for c in muon:  # each stage once per bundle, rows in between, in pipeline order
        seq = [d for d in stages[c.index] if d not in (Do.PACK, Do.APPLY)]
        assert seq == [Do.SEND, Do.ORTHOGONALIZE, Do.RECEIVE]
        assert stages[c.index].count(Do.PACK) == stages[c.index].count(Do.APPLY) == len(c.rows)


@pytest.mark.parametrize("label, lay", LAYOUTS, ids=IDS)
def test_exchanges_overlap_other_bundles_compute(label, lay):
    """Bundle k's all_to_all is outstanding while bundle k+1 is packed, and AdamW rows run
    while Muon exchanges are outstanding (the pipeline's reason to exist)."""
    ops = list(step_schedule(lay, False))
    at = {}
    for i, op in enumerate(ops):
        at.setdefault((op.do, op.bundle.index), i)
    muon = [c.index for c in lay.bundles if c.kind == "muon"]
    assert len(muon) >= 3 and any(c.kind == "adamw" for c in lay.bundles)
    for k, k1 in zip(muon, muon[1:]):
        assert at[(Do.SEND, k)] < at[(Do.PACK, k1)] < at[(Do.ORTHOGONALIZE, k)] < at[(Do.RECEIVE, k)]
    first_send, last_receive = at[(Do.SEND, muon[0])], at[(Do.RECEIVE, muon[-1])]
    assert any(first_send < i < last_receive for i, op in enumerate(ops) if op.do is Do.ADAMW)


@pytest.mark.parametrize("label, lay", LAYOUTS, ids=IDS)
def test_gradients_change_the_store_calls_not_the_collectives(label, lay):
    """Rows of AdamW bundles without a gradient are not acquired; the collectives (every
    rank issues them in the same order) depend on the bundles and direction only."""
    adamw = [p for c in lay.bundles if c.kind == "adamw" for p in c.params]
    every = {p for c in lay.bundles for p in c.params}
    active = every - set(adamw[::2])
    collectives = lambda ops: [(o.do, o.bundle.index, o.slot) for o in ops
                               if o.do in (Do.SEND, Do.ORTHOGONALIZE, Do.RECEIVE)]
    for reverse in (False, True):
        full, some = list(step_schedule(lay, reverse)), list(step_schedule(lay, reverse, active))
        assert collectives(full) == collectives(some)
        assert [(o.do.value, o.bucket) for o in full if o.do in (Do.ACQUIRE, Do.RELEASE)] \
            == store_calls(lay, reverse) == store_calls(lay, reverse, every)
        skipped = {(c.index, j) for c in lay.bundles if c.kind == "adamw"
                   for j, r in enumerate(c.rows) if not any(s.param in active for s in r.segments)}
        assert skipped, "the case should skip a row"
        assert not any((o.bundle.index, o.row) in skipped for o in some
                       if o.do in (Do.ACQUIRE, Do.ADAMW))


@pytest.mark.parametrize("master, budget", [(False, 9), (True, 45)])
def test_the_planners_replay_moves_what_a_real_step_moves(tmp_path, master, budget):
    """The planner's replay of the schedule against the store's policy (plan/step_sim.py)
    reads and writes, step by step and in both directions, the NVMe bytes a real step's
    store counters say, with a pool (``budget`` buckets) smaller than the state. With
    masters, held across stages, within one bucket (write-back timing, as in the plan's
    calibration)."""
    import time

    import torch
    from torch import nn

    from offload_engine.optim import ZeroMuon
    from offload_engine.plan.step_sim import simulate

    model = from_hf_config(dict(TINY_LLAMA, num_hidden_layers=2), name="tiny-llama")
    opts = PlanOptions(world_size=1, gpus_per_node=1, param_dtype=torch.bfloat16,
                       master_weights=master, bucket_bytes=BUCKET, prefetch_depth=2,
                       device="cpu", gpu=False)
    st = rank_states(model, opts)[0]
    want = simulate(st.layout, st.arrays, {n: "nvme" for n in st.layout.arrays},
                    budget * BUCKET, 2, steps=4)
    assert 0 < max(want.read) < st.layout.state_bytes(), "the case should cache part of it"
    module = nn.Module()
    g = torch.Generator().manual_seed(0)
    for t in model.tensors:
        module.register_parameter(t.name.replace(".", "_"), nn.Parameter(
            torch.randn(t.shape, generator=g).to(torch.bfloat16)))
    named = [(t.name, p) for t, p in zip(model.tensors, module.parameters())]
    cfg = {"nvme_paths": [str(tmp_path)], "default_home": "nvme", "bucket_bytes": BUCKET,
           "prefetch_depth": 2, "cpu_budget": budget * BUCKET}
    with ZeroMuon(named, master_weights=master, store=cfg) as opt:
        assert opt.layout.uses() == st.layout.uses()
        for step in range(4):
            for p in module.parameters():
                p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
            opt.step()
            s = opt.last_step_stats
            deadline = time.monotonic() + 10  # write-behind issued in the step is its own
            while opt.store.writes_in_flight and time.monotonic() < deadline:
                time.sleep(0.002)
            late = opt.store.stats(reset=True)
            read = s.store_bytes_read["nvme"] + late.bytes_read["nvme"]
            written = s.store_bytes_written["nvme"] + late.bytes_written["nvme"]
            slack = BUCKET if master else 0
            assert abs(read - want.read[step]) <= slack, (step, read, want.read)
            assert abs(written - want.written[step]) <= slack, (step, written, want.written)


@pytest.mark.parametrize("label, lay", LAYOUTS, ids=IDS)
def test_the_pool_budget_is_the_schedules_peak(label, lay):
    """working_buckets (what ZeroMuon and the planner size the pool by) is one more than
    the most buckets the schedule holds acquired at once, either way; a shared bucket
    counts once however many rows hold it."""
    most = 0
    for reverse in (False, True):
        held: dict = {}
        for op in step_schedule(lay, reverse):
            if op.do is Do.ACQUIRE:
                held.setdefault(op.bucket, set()).add((op.bundle.index, op.row))
            elif op.do is Do.RELEASE:
                held[op.bucket].discard((op.bundle.index, op.row))
                if not held[op.bucket]:
                    del held[op.bucket]
            most = max(most, len(held))
        assert peak_held(lay, reverse) <= most
    assert working_buckets(lay) == most + 1
