"""The Python drop-ins for DeepSpeed's zero_to_fp32 functions (offload_engine.consolidate),
checked against DeepSpeed's own output on every fixture, and on one of our checkpoints."""

import os

import pytest
import torch
from torch import nn

from offload_engine.consolidate import (LazyStateDict, convert_to_safetensors,
                                        get_fp32_state_dict, load_state_dict_from_checkpoint)
from offload_engine.formats import FormatError

from helpers.synthetic import write_checkpoint
from helpers.consolidate_outputs import load_output
from helpers.zero_to_fp32_expected import (DS, FIXTURES, ZERO1_FROZEN, assert_bitwise,
                                           expected, tie_of)


@pytest.mark.parametrize("fixture", FIXTURES, ids=os.path.basename)
def test_get_fp32_state_dict_equals_deepspeed(fixture):
    got = get_fp32_state_dict(fixture)
    assert_bitwise(got, expected(fixture))
    alias, owner = tie_of(fixture)
    assert got[alias] is got[owner]  # tied, as DeepSpeed's dict ties them
    assert list(got)[-1] == alias     # tied names last, as DeepSpeed adds them


@pytest.mark.parametrize("fixture", FIXTURES, ids=os.path.basename)
def test_lazy_reads_on_access_and_equals_deepspeed(fixture):
    with get_fp32_state_dict(fixture, lazy=True) as lazy:
        assert isinstance(lazy, LazyStateDict)
        assert list(lazy) == list(get_fp32_state_dict(fixture))
        first = lazy[next(iter(lazy))]
        assert lazy[next(iter(lazy))] is not first  # read again, not kept
        assert_bitwise({k: lazy[k] for k in lazy}, expected(fixture))
        name = next(iter(lazy))
        assert lazy.shape(name) == tuple(first.shape)
        with pytest.raises(KeyError):
            lazy["no.such.weight"]
    with pytest.raises(ValueError, match="after close"):
        lazy[name]


def test_exclude_frozen_leaves_out_frozen_parameters():
    fixture = os.path.join(DS, "zero3_w3_fp32")
    got = get_fp32_state_dict(fixture, exclude_frozen=True)
    assert not ZERO1_FROZEN & set(got)
    assert "offs" in got  # buffers are not parameters: kept
    lazy = get_fp32_state_dict(fixture, exclude_frozen=True, lazy=True)
    assert list(lazy) == list(got)
    lazy.close()


def test_tag_folder_and_tag_argument_read_the_same():
    fixture = os.path.join(DS, "zero2_w3_fp32")
    by_tag = get_fp32_state_dict(fixture, tag="global_step2")
    by_folder = get_fp32_state_dict(os.path.join(fixture, "global_step2"))
    assert_bitwise(by_tag, expected(fixture))
    assert_bitwise(by_folder, expected(fixture))


@pytest.mark.parametrize("fixture", FIXTURES, ids=os.path.basename)
def test_convert_to_safetensors_equals_deepspeed(tmp_path, fixture):
    result = convert_to_safetensors(fixture, str(tmp_path / "out"), max_shard_size="2KB")
    got, aliases = load_output(tmp_path / "out")
    alias, owner = tie_of(fixture)
    assert aliases == {alias: owner} == result.aliases
    got[alias] = got[owner]
    assert_bitwise(got, expected(fixture))
    assert len(result.files) > 2  # shards and the index: max_shard_size was honoured


def module_with(names_shapes: dict, ties: dict, buffers: set) -> nn.Module:
    """A module tree holding a parameter (or buffer) for each dotted name, zero-filled."""
    root = nn.Module()

    def parent(name):
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if part not in mod._modules:
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        return mod, leaf

    for name, (shape, dtype) in names_shapes.items():
        mod, leaf = parent(name)
        value = torch.zeros(shape, dtype=dtype)
        if name in buffers or not dtype.is_floating_point:
            mod.register_buffer(leaf, value)
        else:
            mod.register_parameter(leaf, nn.Parameter(value))
    for alias, owner in ties.items():
        mod, leaf = parent(alias)
        setattr(mod, leaf, root.get_parameter(owner))
    return root


@pytest.mark.parametrize("fixture", FIXTURES, ids=os.path.basename)
def test_load_state_dict_into_a_plain_model(fixture):
    want = expected(fixture)
    alias, owner = tie_of(fixture)
    present = get_fp32_state_dict(fixture, lazy=True)
    shapes = {k: (tuple(present.shape(k)), want[k].dtype if k in want else torch.float32)
              for k in present if k != alias}
    present.close()
    model = module_with(shapes, {alias: owner}, buffers={"offs", "mask"})
    assert load_state_dict_from_checkpoint(model, fixture) is model
    loaded = model.state_dict()
    assert_bitwise(loaded, want)
    assert model.get_parameter(alias) is model.get_parameter(owner)


def test_load_state_dict_casts_to_the_model_dtype():
    fixture = os.path.join(DS, "zero3_w3_fp32")
    want = expected(fixture)
    model = module_with({k: (tuple(v.shape), torch.bfloat16 if v.is_floating_point() else v.dtype)
                         for k, v in want.items() if k != "head.weight"},
                        {"head.weight": "emb.weight"}, buffers={"offs"})
    load_state_dict_from_checkpoint(model, fixture)
    for k, v in model.state_dict().items():
        assert v.dtype == (torch.bfloat16 if want[k].is_floating_point() else want[k].dtype)
        assert torch.equal(v, want[k].to(v.dtype)), k


def test_strict_names_what_is_missing_and_unexpected(caplog):
    fixture = os.path.join(DS, "zero3_w3_fp32")
    want = expected(fixture)
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in want.items() if k not in ("head.weight", "l2.bias")}
    shapes["extra.weight"] = ((3,), torch.float32)
    model = module_with(shapes, {"head.weight": "emb.weight"}, buffers={"offs"})
    with pytest.raises(FormatError, match=r"missing from the checkpoint: extra\.weight.*"
                                          r"in the checkpoint but not in the model: l2\.bias"):
        load_state_dict_from_checkpoint(model, fixture)
    assert torch.count_nonzero(model.l1.weight) == 0  # nothing copied before the refusal
    load_state_dict_from_checkpoint(model, fixture, strict=False)
    assert "extra.weight" in caplog.text
    assert torch.equal(model.l1.weight, want["l1.weight"])
    assert torch.count_nonzero(model.extra.weight) == 0


def test_shape_mismatch_names_the_tensor():
    fixture = os.path.join(DS, "zero3_w3_fp32")
    want = expected(fixture)
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in want.items() if k != "head.weight"}
    shapes["l1.weight"] = ((16, 13), torch.float32)
    model = module_with(shapes, {"head.weight": "emb.weight"}, buffers={"offs"})
    with pytest.raises(FormatError, match=r"l1\.weight is \[13, 16\] in the checkpoint but \[16, 13\]"):
        load_state_dict_from_checkpoint(model, fixture)
    assert torch.count_nonzero(model.emb.weight) == 0  # nothing copied before the refusal


def test_our_checkpoint_reads_its_parameters(tmp_path):
    gen = torch.Generator().manual_seed(0)
    weights = {"a.weight": torch.randn(7, 5, generator=gen),
               "b.weight": torch.randn(9, generator=gen).to(torch.bfloat16),
               "c.steps": torch.arange(4, dtype=torch.int64)}
    tensors = {name: {"shape": list(v.shape), "dtype": v.dtype,
                      "optimizer": "muon" if v.dim() == 2 else None,
                      "states": {"param": v, **({"momentum_buffer": torch.ones_like(v)}
                                                if v.dim() == 2 else {})}}
               for name, v in weights.items()}
    write_checkpoint(str(tmp_path / "ck"), tensors, world_size=3, step=5)
    got = get_fp32_state_dict(str(tmp_path / "ck"))
    assert list(got) == list(weights)
    assert got["b.weight"].dtype == torch.float32  # floats come out as fp32, exactly
    assert torch.equal(got["b.weight"], weights["b.weight"].float())
    assert torch.equal(got["a.weight"], weights["a.weight"])
    assert torch.equal(got["c.steps"], weights["c.steps"])


def test_a_live_store_is_refused(tmp_path):
    from helpers.synthetic import write_sharded
    write_sharded(str(tmp_path / "store"), {"w": {"shape": [4, 4], "dtype": torch.float32,
                                                  "optimizer": "muon",
                                                  "states": {"momentum_buffer": torch.float32}}},
                  1, kind="store", data=False)
    with pytest.raises(FormatError, match="live store"):
        get_fp32_state_dict(str(tmp_path / "store"))


# -- a model sharded by FSDP2, loaded at world size 2 -----------------------------------------

def _fsdp_worker(rank: int, world: int, init: str, fixture: str, out: str):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        want = expected(fixture)
        model = module_with({k: (tuple(v.shape), v.dtype) for k, v in want.items()
                             if k != "head.weight"}, {"head.weight": "emb.weight"},
                            buffers={"offs"})
        for child in ("l1", "l2", "frozen"):
            fully_shard(getattr(model, child))
        fully_shard(model)
        load_state_dict_from_checkpoint(model, fixture)
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
                for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save(full, out)
        # both ranks done before either tears gloo down: a peer closing its connections
        # while the other still uses them aborted a child (SIGABRT) once in a full run
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_load_into_an_fsdp2_model_at_world_size_2(tmp_path):
    import torch.multiprocessing as mp

    fixture = os.path.join(DS, "zero3_w3_fp32")
    out = str(tmp_path / "full.pt")
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(_fsdp_worker, args=(2, init, fixture, out), nprocs=2,
                       start_method="spawn", join=True)
    assert_bitwise(torch.load(out), expected(fixture))
