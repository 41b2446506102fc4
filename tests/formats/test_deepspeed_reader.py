"""DeepSpeed checkpoint reading: restricted unpickling, partition arithmetic, clear errors.

Fixtures under tests/fixtures/deepspeed/ are real DeepSpeed 0.19.8 checkpoints (see the
README there); deepspeed itself is never imported.
"""

import os
import pickle
import shutil
import sys

import pytest
import torch

from offload_engine.formats.deepspeed import DeepSpeedSource
from offload_engine.formats.deepspeed.partitions import (PartitionError, fragments_layout, split_concat,
                                                        zero3_layout, zero12_layout)
from offload_engine.dtypes import dtype as as_dtype
from offload_engine.formats import ReadRequest
from offload_engine.formats.safe_unpickler import (CheckpointFileError, Inert, TensorRef,
                                                      UnsafePickleError, load_pt)
from offload_engine.cli.main import main

from helpers.deepspeed_checkpoints import ALL, FIXTURES, Z2, Z3, copy_fixture, moment_spans, write_synthetic


def run_cli(args, capsys):
    rc = main(["consolidate", *args])
    return rc, capsys.readouterr()


# -- restricted unpickler ---------------------------------------------------------------------

MARKER_ENV = "OE_TEST_MARKER"


def _write_marker(path):  # what a malicious pickle would like to run
    with open(path, "w") as f:
        f.write("pwned")


class SystemCall:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class FunctionCall:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (_write_marker, (self.marker,))


class EvalCall:
    def __reduce__(self):
        return (eval, ("__import__('os').getpid()",))


@pytest.mark.parametrize("make", [SystemCall, FunctionCall, lambda m: EvalCall()])
def test_malicious_pickle_runs_no_code(tmp_path, make):
    marker = tmp_path / "marker"
    path = tmp_path / "evil.pt"
    torch.save({"optimizer_state_dict": {"x": make(str(marker))}, "w": torch.ones(2)}, path)
    with pytest.raises(UnsafePickleError) as e:
        load_pt(path)
    assert str(path) in str(e.value)
    assert "allow-list" in str(e.value)
    assert not marker.exists()


def test_malicious_rank_file_through_cli(tmp_path, capsys):
    ck = copy_fixture(Z3, tmp_path)
    marker = tmp_path / "marker"
    evil = os.path.join(ck, "global_step2", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    torch.save({"optimizer_state_dict": {"zero_stage": 3, "x": SystemCall(str(marker))}}, evil)
    rc, out = run_cli([ck, str(tmp_path / "out")], capsys)
    assert rc == 2
    assert evil in out.err and "posix.system" in out.err
    assert len(out.err.strip().splitlines()) == 1
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_plain_pickle_is_refused(tmp_path):
    path = tmp_path / "plain.pt"
    path.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointFileError, match="not a readable torch checkpoint"):
        load_pt(path)


def test_deepspeed_classes_become_inert_stand_ins():
    pt = load_pt(os.path.join(Z2, "global_step2", "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    osd = pt.obj["optimizer_state_dict"]
    assert isinstance(osd["zero_stage"], Inert) and osd["zero_stage"].value == 2
    assert osd["loss_scaler"].cur_scale == 1.0
    frag = osd["param_slice_mappings"][0]["emb.weight"]
    assert (frag.start, frag.numel) == (0, 346)
    assert "deepspeed" not in sys.modules


def test_tensors_are_references_not_data():
    pt = load_pt(os.path.join(Z3, "global_step2", "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    flat = pt.obj["optimizer_state_dict"]["fp32_flat_groups"]
    assert all(isinstance(t, TensorRef) for t in flat)
    assert [t.numel for t in flat] == [343, 6]
    assert flat[0].attrs == {"ds_id": "0_3"}


def test_lazy_tensor_spans_hold_the_right_bytes(tmp_path):
    base = torch.arange(40, dtype=torch.float32)
    tagged = torch.arange(6, dtype=torch.float32) * 3
    tagged.ds_id = "7_9"  # a Python attribute: pickled through _rebuild_from_type_v2
    objs = {"param": torch.nn.Parameter(torch.linspace(0, 1, 11)), "bf16": torch.randn(3, 4).to(torch.bfloat16),
            "view": base[10:22].view(3, 4), "scalar": torch.tensor(5, dtype=torch.int64), "tagged": tagged,
            "mask": torch.tensor([True, False])}
    path = tmp_path / "t.pt"
    torch.save(objs, path)
    pt = load_pt(path)
    raw = path.read_bytes()
    for name, want in objs.items():
        ref = pt.obj[name]
        assert isinstance(ref, TensorRef) and ref.shape == tuple(want.shape) and ref.dtype == as_dtype(want.dtype), name
        offset, nbytes = pt.tensor_span(ref)
        got = torch.frombuffer(bytearray(raw[offset:offset + nbytes]), dtype=ref.dtype.torch).reshape(ref.shape)
        assert torch.equal(got, want.detach()), name
    assert pt.obj["tagged"].attrs == {"ds_id": "7_9"}
    assert pt.obj["view"].offset == 10


# -- only the fp32 master bytes are read ---------------------------------------------------------


@pytest.mark.parametrize("fixture", ALL)
def test_adam_moments_are_never_read(fixture):
    with DeepSpeedSource(os.path.join(FIXTURES, fixture)) as src:
        src.reader.trace = []
        src.read([ReadRequest(i.name, 0, torch.empty(i.numel, dtype=i.dtype.torch)) for i in src.tensors()])
        moments = {pt.path: moment_spans(pt) for pt in src._optims}
        assert moments and all(moments.values())
        for file, offset, nbytes in src.reader.trace:
            for lo, hi in moments.get(src.reader.paths[file], []):
                assert offset + nbytes <= lo or offset >= hi, (fixture, file, offset, nbytes, lo, hi)
        # and the reads were merged: one run per optimizer file for one batch
        optim_runs = [f for f, _, _ in src.reader.trace if f < len(src._optims)]
        assert sorted(optim_runs) == list(range(len(src._optims)))


def test_ranged_reads_match_whole_reads():
    with DeepSpeedSource(Z3) as src:
        info = next(i for i in src.tensors() if i.name == "emb.weight")
        whole = torch.empty(info.numel, dtype=info.dtype.torch)
        src.read([ReadRequest(info.name, 0, whole)])
        parts = [torch.empty(n, dtype=info.dtype.torch) for n in (1, 196, 198, 197)]
        starts = [0, 1, 197, 395]
        src.read([ReadRequest(info.name, s, p) for s, p in zip(starts, parts)])
        assert torch.equal(torch.cat(parts), whole)


# -- partition arithmetic --------------------------------------------------------------------------

def test_split_concat():
    assert split_concat(3, 6, [4, 2, 5]) == [(0, 3, 0, 1), (1, 0, 1, 2), (2, 0, 3, 3)]
    with pytest.raises(PartitionError):
        split_concat(8, 4, [4, 5])


def test_zero3_padding_on_several_trailing_ranks():
    # numel 9 over 8 ranks: 2 per rank, ranks 5..7 hold only padding
    layout = zero3_layout([("w", 9)], [[2]] * 8)
    pieces = layout["w"]
    assert [(p.start, p.count, p.src) for p in pieces] == [(0, 2, (0, 0)), (2, 2, (1, 0)), (4, 2, (2, 0)),
                                                           (6, 2, (3, 0)), (8, 1, (4, 0))]


def test_zero3_sub_groups_and_offsets():
    # a: 5 -> P=3, b: 4 -> P=2 on 2 ranks; sub-groups [3] and [2]
    layout = zero3_layout([("a", 5), ("b", 4)], [[3, 2], [3, 2]])
    assert [(p.start, p.count, p.src, p.src_offset) for p in layout["a"]] == [(0, 3, (0, 0), 0), (3, 2, (1, 0), 0)]
    assert [(p.start, p.count, p.src, p.src_offset) for p in layout["b"]] == [(0, 2, (0, 1), 0), (2, 2, (1, 1), 0)]
    with pytest.raises(PartitionError):
        zero3_layout([("a", 5), ("b", 4)], [[3, 2], [3, 3]])


def test_zero12_parameter_alignment_padding():
    # a (3) + 1 padding, b (4): flat of 8 over 2 ranks
    layout = zero12_layout([[("a", 3), ("b", 4)]], [[4], [4]], [[1, 0]])
    assert [(p.start, p.count, p.src, p.src_offset) for p in layout["b"]] == [(0, 4, (1, 0), 0)]
    with pytest.raises(PartitionError):
        zero12_layout([[("a", 3), ("b", 4)]], [[4], [4]], [[1]])


def test_zero12_groups_across_ranks():
    # group 0: 7 elements padded to 8 (2*ws, ws=2) -> partitions 4 and 3 saved
    layout = zero12_layout([[("a", 3), ("b", 4)], [("c", 2)]], [[4, 2], [3, 0]])
    assert [(p.start, p.count, p.src, p.src_offset) for p in layout["b"]] == [(0, 1, (0, 0), 3), (1, 3, (1, 0), 0)]
    assert [(p.src, p.count) for p in layout["c"]] == [((0, 1), 2)]
    with pytest.raises(PartitionError):
        zero12_layout([[("a", 3)]], [[4], [4]])  # 8 available, 3 used: beyond the alignment


def test_fragments_layout():
    assert [(p.start, p.count, p.src) for p in fragments_layout(5, [(0, 2), (1, 2), (2, 2)])] == \
        [(0, 2, 0), (2, 2, 1), (4, 1, 2)]


# -- clear errors -----------------------------------------------------------------------------------

def test_missing_latest(tmp_path, capsys):
    ck = copy_fixture(Z2, tmp_path)
    os.remove(os.path.join(ck, "latest"))
    rc, out = run_cli([ck, str(tmp_path / "out")], capsys)
    assert rc == 2
    assert os.path.join(ck, "latest") in out.err and "--tag" in out.err and "global_step2" in out.err
    rc, out = run_cli([ck, str(tmp_path / "out"), "--tag", "global_step2"], capsys)
    assert rc == 0


def test_missing_tag_dir(tmp_path, capsys):
    rc, out = run_cli([Z2, str(tmp_path / "out"), "--tag", "global_step9"], capsys)
    assert rc == 2 and os.path.join(Z2, "global_step9") in out.err and "not found" in out.err


def test_missing_src(tmp_path, capsys):
    rc, out = run_cli([str(tmp_path / "nothing"), str(tmp_path / "out")], capsys)
    assert rc == 2 and str(tmp_path / "nothing") in out.err


def test_missing_rank_file(tmp_path, capsys):
    ck = copy_fixture(Z3, tmp_path)
    gone = os.path.join(ck, "global_step2", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    os.remove(gone)
    rc, out = run_cli([ck, str(tmp_path / "out")], capsys)
    assert rc == 2 and gone in out.err and "missing rank file" in out.err


def test_missing_model_states_file(tmp_path, capsys):
    ck = copy_fixture(Z3, tmp_path)
    gone = os.path.join(ck, "global_step2", "zero_pp_rank_2_mp_rank_00_model_states.pt")
    os.remove(gone)
    rc, out = run_cli([ck, str(tmp_path / "out")], capsys)
    assert rc == 2 and gone in out.err and "missing model states" in out.err


def test_extra_rank_file(tmp_path, capsys):
    ck = copy_fixture(Z2, tmp_path)
    tag = os.path.join(ck, "global_step2")
    extra = os.path.join(tag, "zero_pp_rank_3_mp_rank_00_optim_states.pt")
    shutil.copy(os.path.join(tag, "zero_pp_rank_2_mp_rank_00_optim_states.pt"), extra)
    rc, out = run_cli([ck, str(tmp_path / "out")], capsys)
    assert rc == 2 and extra in out.err and "partition_count 3" in out.err


@pytest.mark.parametrize("damage", ["truncate_tail", "truncate_half", "garbage", "empty"])
def test_damaged_rank_file(tmp_path, capsys, damage):
    ck = copy_fixture(Z2, tmp_path)
    bad = os.path.join(ck, "global_step2", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    data = open(bad, "rb").read()
    data = {"truncate_tail": data[:-30], "truncate_half": data[: len(data) // 2],
            "garbage": os.urandom(len(data)), "empty": b""}[damage]
    with open(bad, "wb") as f:
        f.write(data)
    rc, out = run_cli([ck, str(tmp_path / "out")], capsys)
    assert rc == 2, out
    assert bad in out.err
    assert len(out.err.strip().splitlines()) == 1


def test_record_truncated_inside_data(tmp_path, capsys):
    """A file whose zip directory survives but whose data records were cut short."""
    ck = copy_fixture(Z3, tmp_path)
    bad = os.path.join(ck, "global_step2", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    pt = load_pt(bad)
    span = pt.archive.record_span(pt.obj["optimizer_state_dict"]["fp32_flat_groups"][0].storage.key)
    data = bytearray(open(bad, "rb").read())
    # zero the local header magic of the fp32 record: the central directory still lists it
    header = data.rfind(b"PK\x03\x04", 0, span.offset)
    data[header:header + 4] = b"\0\0\0\0"
    with open(bad, "wb") as f:
        f.write(data)
    rc, out = run_cli([ck, str(tmp_path / "out")], capsys)
    assert rc == 2 and bad in out.err and "corrupt" in out.err


# -- synthetic checkpoints: edge cases real runs rarely hit -------------------------------------------


def read_all(src):
    out = {}
    for i in src.tensors():
        t = torch.empty(i.numel, dtype=i.dtype.torch)
        src.read([ReadRequest(i.name, 0, t)])
        out[i.name] = t.reshape(i.shape)
    return out


@pytest.mark.parametrize("stage,world_size,align", [(3, 8, 1), (3, 5, 1), (2, 8, 1), (1, 5, 1), (2, 1, 1),
                                                    (3, 1, 1), (2, 3, 4), (1, 2, 16)])
def test_synthetic_layouts(tmp_path, stage, world_size, align):
    g = torch.Generator().manual_seed(stage * 10 + world_size)
    params = {"a": torch.randn(9, generator=g), "b": torch.randn(1, generator=g),
              "c": torch.randn(3, 5, generator=g), "d": torch.randn(2, generator=g),
              "e": torch.randn(17, 3, generator=g)}
    buffers = {"step": torch.tensor([2**53 + 1]), "flag": torch.tensor(True)}
    write_synthetic(tmp_path, stage, world_size, params, groups=[["a", "b", "c"], ["d", "e"]],
                    sub_group_numel=4, buffers=buffers, param_align=align)
    with DeepSpeedSource(str(tmp_path)) as src:
        got = read_all(src)
    assert list(got) == ["step", "flag", "a", "b", "c", "d", "e"]
    for name, want in {**buffers, **params}.items():
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name


def test_synthetic_bad_partition_sizes(tmp_path, capsys):
    params = {"a": torch.randn(10), "b": torch.randn(7)}
    write_synthetic(tmp_path, 3, 2, params, sub_group_numel=100)
    # rank 1 claims one more parameter than it holds
    path = os.path.join(tmp_path, "global_step1", "zero_pp_rank_1_mp_rank_00_model_states.pt")
    model = torch.load(path, weights_only=False)
    model["param_shapes"][0]["z"] = torch.Size([40])
    for r in range(2):
        torch.save(model, os.path.join(tmp_path, "global_step1", f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"))
    rc, out = run_cli([str(tmp_path), str(tmp_path / "out")], capsys)
    assert rc == 2 and "partitions do not match" in out.err and os.path.join(str(tmp_path), "global_step1") in out.err


def test_few_descriptors_for_many_rank_files():
    with DeepSpeedSource(os.path.join(FIXTURES, "zero3_w4_bf16")) as src:
        want = read_all(src)
    with DeepSpeedSource(os.path.join(FIXTURES, "zero3_w4_bf16")) as src:
        src.reader.max_open = 1
        got = read_all(src)
        assert len(src.reader._fds) <= 1
    assert all(torch.equal(got[n], want[n]) for n in want)
