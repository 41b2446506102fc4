"""ZeroMuon through torch.distributed.checkpoint, as torchtitan's checkpointer calls it.

get/set_optimizer_state_dict (flattened, torchtitan's default, and nested) inside Stateful
wrappers handed to dcp.save / dcp.load (tests/helpers/dcp_flow.py). A run at W=2 (FSDP2, bf16
parameters with fp32 master weights, Muon and AdamW parameters, state in an NVMe store whose
pinned budget is smaller than the state) saves after 2 steps, goes on 2 more; resumed from
the DCP checkpoint at W=2 and at W=1 into a fresh model and optimizer, the same 2 steps give
every parameter and every state tensor bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

from helpers import dcp_flow
from offload_engine.optim import ZeroMuon
from helpers.zero_muon_harness import MIXED_SHAPES, Bag, make_pair, set_grads, spawn
from helpers.paths import child_env, script

KiB = 4096
MUON = dict(lr=0.02, weight_decay=0.1)
ADAMW = dict(lr=3e-3, weight_decay=0.05)
SAVED_AT, STEPS = 2, 4


def _store(path: str) -> dict:
    return {"nvme_paths": [path], "bucket_bytes": KiB, "cpu_budget": 14 * KiB,
            "prefetch_depth": 1, "acquire_timeout_s": 20, "io_threads": 2}


def _bf16_pair(mesh, seed: int):
    model, ref = Bag(MIXED_SHAPES, seed).to(torch.bfloat16), Bag(MIXED_SHAPES, seed)
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard
        fully_shard(model, mesh=mesh)
    return model, ref


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _snapshot(model, opt) -> dict:
    """Every parameter and state tensor, full (collective: every rank calls it)."""
    out = {f"param/{n}": _full(p) for n, p in model.named_parameters()}
    sd = opt.state_dict()["state"]
    for info in opt.infos:
        for k, v in sd[info.index].items():
            out[f"state/{info.name}/{k}"] = _full(v)
    return out


def _train(model, ref, opt, steps, rank, world) -> None:
    for step in steps:
        set_grads(model, ref, step, rank, world)
        opt.step()
        opt.zero_grad(set_to_none=True)


def _first_run(rank, world, mesh, tmp, flatten):
    model, ref = _bf16_pair(mesh, seed=3)
    opt = ZeroMuon(model.named_parameters(), **MUON, adamw=ADAMW, master_weights=True,
                   store=_store(os.path.join(tmp, f"store-a{rank}")))
    _train(model, ref, opt, range(SAVED_AT), rank, world)
    dcp_flow.save(os.path.join(tmp, "dcp"), model, opt, flatten)
    _train(model, ref, opt, range(SAVED_AT, STEPS), rank, world)
    want = _snapshot(model, opt)
    if rank == 0:
        torch.save(want, os.path.join(tmp, "want.pt"))
    opt.close()


def _resume(rank, world, mesh, tmp, flatten):
    # another seed: every value must come from the checkpoint
    model, ref = _bf16_pair(mesh, seed=11)
    opt = ZeroMuon(model.named_parameters(), **MUON, adamw=ADAMW, master_weights=True,
                   store=_store(os.path.join(tmp, f"store-w{world}-{rank}")))
    dcp_flow.load(os.path.join(tmp, "dcp"), model, opt, flatten)
    _train(model, ref, opt, range(SAVED_AT, STEPS), rank, world)
    got = _snapshot(model, opt)
    opt.close()
    want = torch.load(os.path.join(tmp, "want.pt"))
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), \
            f"W={world}: {k} differs after the resumed steps"


@pytest.mark.multiprocess
@pytest.mark.parametrize("flatten", [True, False], ids=["flattened", "nested"])
def test_dcp_save_at_w2_resumes_bitwise_at_w2_and_w1(tmp_path, flatten):
    tmp = str(tmp_path)
    spawn(2, _first_run, tmp, flatten)
    spawn(2, _resume, tmp, flatten)
    spawn(1, _resume, tmp, flatten)


# -- single process: the calls themselves -------------------------------------------------------
def _plain_run(path, seed=0):
    model, ref = make_pair(MIXED_SHAPES, None, seed=seed)
    opt = ZeroMuon(model.named_parameters(), **MUON, adamw=ADAMW, store=_store(path))
    return model, ref, opt


@pytest.mark.parametrize("flatten", [True, False], ids=["flattened", "nested"])
def test_get_set_optimizer_state_dict_into_a_fresh_optimizer(tmp_path, flatten):
    """The reported failure: set_optimizer_state_dict with flatten_optimizer_state_dict=True
    raised KeyError "... has no 'momentum_buffer'" (torch's unflatten walks optim.state)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    model, ref, opt = _plain_run(str(tmp_path / "a"))
    _train(model, ref, opt, range(2), 0, 1)
    osd = get_optimizer_state_dict(model, opt, options=options)
    if flatten:
        assert "state.w_big.momentum_buffer" in osd and "state.bias.exp_avg_sq" in osd
    model2, _, opt2 = _plain_run(str(tmp_path / "b"), seed=7)
    model2.load_state_dict(model.state_dict())
    set_optimizer_state_dict(model2, opt2, optim_state_dict=osd, options=options)
    _train(model, ref, opt, range(2, 4), 0, 1)
    _train(model2, ref, opt2, range(2, 4), 0, 1)
    assert _snapshot(model2, opt2).keys() == _snapshot(model, opt).keys()
    for (k, a), b in zip(_snapshot(model, opt).items(), _snapshot(model2, opt2).values()):
        assert torch.equal(a, b), k
    opt.close()
    opt2.close()


def test_dcp_writer_with_several_threads(tmp_path):
    """DCP's FileSystemWriter with thread_count=4 reads the store from four threads at once
    (each writes its own files): the resumed optimizer's next steps are bitwise."""
    import torch.distributed.checkpoint as dcp
    model, ref, opt = _plain_run(str(tmp_path / "a"))
    _train(model, ref, opt, range(2), 0, 1)
    ck = str(tmp_path / "dcp")
    dcp.save(dcp_flow.states(model, opt, True), storage_writer=dcp.FileSystemWriter(ck, thread_count=4))
    assert len([f for f in os.listdir(ck) if f.endswith(".distcp")]) > 1  # threads did write
    model2, _, opt2 = _plain_run(str(tmp_path / "b"), seed=7)
    _train(model2, ref, opt2, range(1), 0, 1)
    dcp.load(dcp_flow.states(model2, opt2, True), storage_reader=dcp.FileSystemReader(ck))
    _train(model, ref, opt, range(2, 4), 0, 1)
    _train(model2, ref, opt2, range(2, 4), 0, 1)
    for (k, a), b in zip(_snapshot(model, opt).items(), _snapshot(model2, opt2).values()):
        assert torch.equal(a, b), k
    opt.close()
    opt2.close()


def test_optimizer_state_is_a_view_of_the_store(tmp_path):
    """optim.state lists each parameter with state and all its keys (what torch's helpers
    read) without holding tensors; values are read from the store when used."""
    from offload_engine.optim.lazy_state import StoreTensor
    model, ref, opt = _plain_run(str(tmp_path / "a"))
    assert not opt.state  # before the first step: torch's helpers then initialize it
    _train(model, ref, opt, range(1), 0, 1)
    params = dict(model.named_parameters())
    assert len(opt.state) == len(params)
    assert list(opt.state[params["w_big"]]) == ["momentum_buffer"]
    entry = opt.state[params["bias"]]
    assert sorted(entry) == ["exp_avg", "exp_avg_sq", "step"] and float(entry["step"]) == 1
    assert isinstance(entry["exp_avg"], StoreTensor)
    assert torch.equal(entry["exp_avg"], opt.state_dict()["state"][opt.optimizer_state.info_of(params["bias"]).index]["exp_avg"])
    opt.close()


def test_a_state_dict_keeps_its_values_across_step_load_and_close(tmp_path):
    """The tensors of a state dict are read lazily but are the values of the call, as the
    copies of the eager state dict were: a later step, load or close does not change them."""
    import copy
    model, ref, opt = _plain_run(str(tmp_path / "a"))
    _train(model, ref, opt, range(2), 0, 1)
    sd = opt.state_dict()
    want = copy.deepcopy(sd)  # eager copies
    _train(model, ref, opt, range(2, 3), 0, 1)
    now = opt.state_dict()
    w = now["state"][1]["momentum_buffer"]
    assert not torch.equal(w, want["state"][1]["momentum_buffer"])
    opt.load_state_dict(want)  # back to the saved values
    assert torch.equal(w, now["state"][1]["momentum_buffer"])  # `now` kept its own
    opt.close()
    for i, entry in want["state"].items():
        for k, v in entry.items():
            assert torch.equal(sd["state"][i][k], v), (i, k)


def test_dcp_is_handed_host_tensors_that_hold_no_bytes_whatever_the_state_device(tmp_path):
    """DCP's writer copies a device tensor to host memory when it reaches it and keeps the
    copy until the rank's file is written: on CUDA the whole state would sit in host memory.
    So what DCP takes from a state tensor (``__get_tensor_shard__``) is a host StoreTensor,
    still lazy, with the state's values; slices of it stay lazy on the host, and a load's
    copy into it changes the optimizer's state. A StoreTensor on "meta" stands in here for
    one on CUDA (this machine has none; tools/gpu_check.py measures the real one)."""
    import io
    from offload_engine.optim.lazy_state import StoreTensor
    model, ref, opt = _plain_run(str(tmp_path / "a"))
    _train(model, ref, opt, range(2), 0, 1)
    mine = opt.state_dict()["state"][1]["momentum_buffer"]
    want = mine.clone()
    on_device = StoreTensor(mine._src, (), torch.device("meta"))
    shard = on_device.__get_tensor_shard__(None)
    assert isinstance(shard, StoreTensor) and shard.device.type == "cpu"
    assert shard._src.data is None  # nothing read
    assert shard.untyped_storage().size() == shard.nbytes  # DCP does not clone it
    buf = io.BytesIO()
    torch.save(shard, buf)  # what DCP's writer does with it
    assert torch.equal(torch.load(io.BytesIO(buf.getvalue())), want)
    rows = shard[1:3]
    assert isinstance(rows, StoreTensor) and rows.device.type == "cpu"
    assert torch.equal(rows, want[1:3])
    earlier = opt.state_dict()["state"][1]["momentum_buffer"]
    rows.copy_(torch.full_like(want[1:3], 7.0))  # what dcp.load does with it
    expected = want.clone()
    expected[1:3] = 7.0
    assert torch.equal(mine, expected)  # rows is a view of it, as DCP's are of the state's
    assert torch.equal(opt.state_dict()["state"][1]["momentum_buffer"], expected)
    assert torch.equal(earlier, want)  # a state dict taken before the change keeps its values
    opt.close()


# -- memory ---------------------------------------------------------------------------------------
@pytest.mark.multiprocess
def test_dcp_save_and_load_hold_one_parameters_state_not_the_whole(tmp_path):
    """dcp.save and dcp.load of a state 32 times its largest parameter's grow the process's
    peak RSS by less than a quarter of the state (measured: 2.5 MiB for save, 3.4 MiB for load, of 32 MiB; eagerly
    read, 33 and 34 MiB); read
    eagerly, the state dict alone is the whole state."""
    import json
    import subprocess
    import sys
    # every large block mmapped and unmapped when freed: RSS then follows live memory, not
    # heap the allocator kept from earlier frees (which would hide a whole-state copy)
    env = child_env(dict(os.environ, PYTHONWARNINGS="ignore", MALLOC_MMAP_THRESHOLD_="131072"))
    out = subprocess.run([sys.executable, script("dcp_memory.py"), str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["differed_before"] and m["loaded_equal"]
    assert m["state_bytes"] >= 32 * m["largest_param_state_bytes"]
    for what in ("state_save_growth", "save_growth", "load_growth"):
        assert m[what] < m["state_bytes"] // 4, (what, m)


def test_get_set_state_dict_with_model_and_optimizer(tmp_path):
    """get_state_dict / set_state_dict (model and optimizer together, flattened) through
    dcp.save / dcp.load, into a fresh model and optimizer: the next steps are bitwise."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                         set_state_dict)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model, ref, opt = _plain_run(str(tmp_path / "a"))
    _train(model, ref, opt, range(2), 0, 1)
    msd, osd = get_state_dict(model, opt, options=options)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "dcp"))
    del msd, osd
    model2, _, opt2 = _plain_run(str(tmp_path / "b"), seed=7)
    msd, osd = get_state_dict(model2, opt2, options=options)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "dcp"))
    set_state_dict(model2, opt2, model_state_dict=msd, optim_state_dict=osd, options=options)
    _train(model, ref, opt, range(2, 4), 0, 1)
    _train(model2, ref, opt2, range(2, 4), 0, 1)
    want, got = _snapshot(model, opt), _snapshot(model2, opt2)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    opt.close()
    opt2.close()
