"""DeepSpeed mixture-of-experts checkpoints: per-expert files, expert-parallel partitions.

Fixtures under tests/fixtures/deepspeed_moe/ are real DeepSpeed 0.19.8 runs (ZeRO-1/2,
expert-parallel sizes 1 and 2, W=2 and 4, fp32 and bf16; see the README there) with what
DeepSpeed itself held at save time in ``expected.safetensors``. deepspeed is never imported.
"""

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from offload_engine.cli.main import main
from offload_engine.consolidate import get_fp32_state_dict
from offload_engine.formats import ReadRequest
from offload_engine.formats.deepspeed import DeepSpeedLayoutError, DeepSpeedSource
from offload_engine.formats.deepspeed.experts import ep_ranks
from offload_engine.formats.deepspeed.partitions import Piece, zero3_replica_layout, zero12_replica_layout

from helpers import paths
from helpers.deepspeed_checkpoints import copy_fixture
from helpers.deepspeed_moe import AUTOEP, EP2_W4, MOE, NATIVE, RUNS, expected

EXPERT = "moe{}.deepspeed_moe.experts.deepspeed_experts.{}.{}"


def consolidate_cli(args, capsys):
    rc = main(["consolidate", *args])
    return rc, capsys.readouterr()


def test_fixtures_cover_the_runs_asked_for():
    assert {"zero1_ep1_w2_fp32", "zero2_ep2_w2_fp32", "zero2_ep2_w4_fp32",
            "zero2_ep2_w4_fp32_datafirst", "zero2_ep2_w2_bf16"} == set(NATIVE)
    assert {"zero3_autoep2_w2_fp32", "zero3_autoep2_w4_fp32"} == set(AUTOEP)


def buffers(run: str) -> set[str]:
    return set() if run in AUTOEP else {"scale"}


@pytest.mark.parametrize("run", RUNS)
def test_reader_gives_deepspeeds_masters_and_moments_bitwise(run):
    """Every parameter, experts of every expert-parallel rank included (native MoE: one
    tensor per expert under its global id; AutoEP: [experts, out, in] stacks): master and
    both Adam moments equal DeepSpeed's own, bit for bit."""
    want = expected(run)
    with DeepSpeedSource(os.path.join(MOE, run)) as src:
        tensors = {t.name: t for t in src.tensors()}
        assert set(tensors) == set(want["master"]) | buffers(run)
        for state, values in want.items():
            for name, value in values.items():
                meta = tensors[name]
                assert meta.shape == tuple(value.shape), name
                key = "master" if state == "master" else state
                buf = torch.empty(meta.numel, dtype=meta.states[key].dtype.torch)
                src.read([ReadRequest(name, 0, buf, key)])
                assert torch.equal(buf.view(value.shape), value), (name, state)
                assert meta.extra["adam_step"] == 2.0
        assert any("mixture-of-experts" in n for n in src.info.notes)
        if run in AUTOEP:
            assert tensors["model.layers.1.mlp.experts.w2"].shape == (4, 8, 4)
            assert src.experts == {f"model.layers.{i}.mlp.experts": 4 for i in (0, 1)}
            return
        assert src.experts == {"moe0": 4, "moe1": 4}
        # experts listed by layer, then global expert id
        order = [t.name for t in src.tensors() if ".experts." in t.name]
        assert order[:6] == [EXPERT.format(0, e, p) for e in (0, 1)
                             for p in ("w1.weight", "w1.bias", "w2.weight")]
        files = {os.path.basename(p) for p, _ in src.info.files}
        assert "layer_1_expert_3_mp_rank_00_model_states.pt" in files


@pytest.mark.parametrize("run", RUNS)
def test_consolidate_equals_deepspeeds_fp32_weights(tmp_path, run, capsys):
    out = str(tmp_path / "out")
    rc, _ = consolidate_cli([os.path.join(MOE, run), out], capsys)
    assert rc == 0
    got = load_file(os.path.join(out, "model.safetensors"))
    masters = expected(run)["master"]
    assert set(got) == set(masters) | buffers(run)
    for name, value in masters.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], value), name


def test_python_api_consolidates_experts():
    masters = expected("zero2_ep2_w4_fp32")["master"]
    state = get_fp32_state_dict(EP2_W4)
    for name, value in masters.items():
        assert torch.equal(state[name], value), name


@pytest.mark.parametrize("run", [r for r in NATIVE if r.endswith("fp32")])
def test_expert_files_agree_with_the_partitions(run):
    """DeepSpeed's own per-expert files (global ids, written by the rank holding each
    expert) hold the weights the reader assembles from the optimizer partitions."""
    masters = expected(run)["master"]
    tag = os.path.join(MOE, run, "global_step2")
    seen = 0
    for name in os.listdir(tag):
        if name.startswith("layer_"):
            for key, value in torch.load(os.path.join(tag, name), weights_only=True).items():
                assert torch.equal(value, masters[key]), (name, key)
                seen += 1
    assert seen == 2 * 4 * 3


def test_data_first_groups_follow_the_config():
    """``use_data_before_expert_parallelism`` puts experts 0-1 on ranks 0-1: read as the
    default grouping (ranks 0 and 2), half the expert tensors come out wrong."""
    run = "zero2_ep2_w4_fp32_datafirst"
    path = os.path.join(MOE, run, "global_step2", "mp_rank_00_model_states.pt")
    assert torch.load(path, weights_only=True)["ds_config"]["use_data_before_expert_parallelism"]
    masters = expected(run)["master"]
    state = get_fp32_state_dict(os.path.join(MOE, run))
    assert all(torch.equal(state[n], v) for n, v in masters.items())


def test_expert_parallel_ranks():
    assert ep_ranks(4, 2, data_first=False) == [[0, 2], [1, 3]]  # DeepSpeed's default
    assert ep_ranks(4, 2, data_first=True) == [[0, 1], [2, 3]]
    assert ep_ranks(2, 2, data_first=False) == [[0], [1]]


def test_replica_layout_puts_each_experts_copy_on_its_ranks():
    """A dense group over 4 ranks, an expert group over expert data-parallel pairs."""
    dense = [(list(range(4)), [("a", 6)])]
    experts = [([0, 2], [("e0", 5)]), ([1, 3], [("e1", 5)])]
    numels = [[2, 3], [2, 3], [2, 2], [0, 3]]  # [rank][group]; rank 3's dense part: padding
    layout = zero12_replica_layout([dense, experts], numels)
    assert layout["a"] == [Piece(0, 2, (0, 0), 0), Piece(2, 2, (1, 0), 0), Piece(4, 2, (2, 0), 0)]
    assert layout["e0"] == [Piece(0, 3, (0, 1), 0), Piece(3, 2, (2, 1), 0)]
    assert layout["e1"] == [Piece(0, 3, (1, 1), 0), Piece(3, 2, (3, 1), 0)]


def test_zero3_replica_layout_gives_each_partition_group_its_copy():
    """AutoEP at ep 2 x expert data-parallel 2: a dense sub-group over all 4 ranks, an
    expert sub-group over ranks (0, 2) and (1, 3)."""
    dense, experts = (0, 1, 2, 3), [(0, 2), (1, 3), (0, 2), (1, 3)]
    partitions = [[(dense, r), (experts[r], r // 2)] for r in range(4)]
    numels = [[2, 3]] * 4  # "d" (7 elements: 2 a rank, padded), then "e" (5: 3 a rank)
    layout = zero3_replica_layout([("d", 7), ("e", 5)], numels, partitions)
    assert list(layout["d"]) == [dense]
    assert [p.count for p in layout["d"][dense]] == [2, 2, 2, 1]
    assert layout["e"][(0, 2)] == [Piece(0, 3, (0, 1), 0), Piece(3, 2, (2, 1), 0)]
    assert layout["e"][(1, 3)] == [Piece(0, 3, (1, 1), 0), Piece(3, 2, (3, 1), 0)]


# -- bad input: one line naming the file, exit 2, nothing written --------------------------------

def _refused(ck, tmp_path, capsys, *needles):
    out = tmp_path / "out"
    rc, res = consolidate_cli([ck, str(out)], capsys)
    assert rc == 2, res
    assert len(res.err.strip().splitlines()) == 1, res.err
    for needle in needles:
        assert needle in res.err, res.err
    assert not out.exists()
    return res.err


def test_missing_expert_file(tmp_path, capsys):
    ck = copy_fixture(EP2_W4, tmp_path)
    gone = os.path.join(ck, "global_step2", "layer_1_expert_2_mp_rank_00_model_states.pt")
    os.remove(gone)
    _refused(ck, tmp_path, capsys, gone, "missing expert file", "4 experts")


def test_missing_moe_layer(tmp_path, capsys):
    ck = copy_fixture(EP2_W4, tmp_path)
    tag = os.path.join(ck, "global_step2")
    for e in range(4):
        os.remove(os.path.join(tag, f"layer_1_expert_{e}_mp_rank_00_model_states.pt"))
    _refused(ck, tmp_path, capsys, os.path.join(tag, "mp_rank_00_model_states.pt"),
             "2 MoE layers")


def test_every_expert_file_missing(tmp_path, capsys):
    ck = copy_fixture(EP2_W4, tmp_path)
    tag = os.path.join(ck, "global_step2")
    for name in os.listdir(tag):
        if name.startswith("layer_"):
            os.remove(os.path.join(tag, name))
    _refused(ck, tmp_path, capsys, os.path.join(tag, "mp_rank_00_model_states.pt"),
             "2 MoE layers", "hold 0")


def test_extra_expert_file(tmp_path, capsys):
    ck = copy_fixture(EP2_W4, tmp_path)
    tag = os.path.join(ck, "global_step2")
    extra = os.path.join(tag, "layer_0_expert_4_mp_rank_00_model_states.pt")
    shutil.copy(os.path.join(tag, "layer_0_expert_3_mp_rank_00_model_states.pt"), extra)
    _refused(ck, tmp_path, capsys, extra, "expert counts differ")


def _rewrite_model_states(ck, edit):
    path = os.path.join(ck, "global_step2", "mp_rank_00_model_states.pt")
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)
    return path


def test_expert_count_differs_from_the_partitions(tmp_path, capsys):
    """The model states say 8 experts in layer 0; the optimizer partitions hold 2 per
    expert-parallel rank of 2 (4 experts)."""
    ck = copy_fixture(EP2_W4, tmp_path)
    path = _rewrite_model_states(ck, lambda s: s.__setitem__("num_experts", [8, 4]))
    _refused(ck, tmp_path, capsys, path, "expert counts differ", "'moe0'")


def test_absurd_expert_count_is_refused_at_once(tmp_path, capsys):
    """A count from a hostile file is compared, never enumerated."""
    ck = copy_fixture(EP2_W4, tmp_path)
    path = _rewrite_model_states(ck, lambda s: s.__setitem__("num_experts", [2 ** 62, 4]))
    _refused(ck, tmp_path, capsys, path, "expert counts differ", "experts 0..1 per rank")


def test_expert_file_with_other_shapes(tmp_path, capsys):
    ck = copy_fixture(EP2_W4, tmp_path)
    path = os.path.join(ck, "global_step2", "layer_0_expert_1_mp_rank_00_model_states.pt")
    state = torch.load(path, weights_only=True)
    name = EXPERT.format(0, 1, "w1.weight")
    state[name] = state[name].t().contiguous()
    torch.save(state, path)
    _refused(ck, tmp_path, capsys, path, name, "[8, 12]", "[12, 8]")


def test_expert_file_of_another_expert(tmp_path, capsys):
    """Expert 1's file holding expert 2's weights (files shuffled or mixed runs)."""
    ck = copy_fixture(EP2_W4, tmp_path)
    tag = os.path.join(ck, "global_step2")
    wrong = os.path.join(tag, "layer_0_expert_1_mp_rank_00_model_states.pt")
    shutil.copy(os.path.join(tag, "layer_0_expert_2_mp_rank_00_model_states.pt"), wrong)
    _refused(ck, tmp_path, capsys, wrong, EXPERT.format(0, 1, "w1.weight"), "missing")


class _Touch:
    """What a malicious pickle would like to run: ``touch marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_expert_file_runs_no_code(tmp_path, capsys):
    """Expert files go through the same restricted unpickler as the rank files."""
    ck = copy_fixture(EP2_W4, tmp_path)
    marker = tmp_path / "marker"
    path = os.path.join(ck, "global_step2", "layer_1_expert_3_mp_rank_00_model_states.pt")
    torch.save({EXPERT.format(1, 3, "w1.weight"): _Touch(str(marker))}, path)
    _refused(ck, tmp_path, capsys, path, "refusing to load", "posix.system")
    assert not marker.exists()


def test_refusal_leaves_an_existing_out_untouched(tmp_path, capsys):
    ck = copy_fixture(EP2_W4, tmp_path)
    os.remove(os.path.join(ck, "global_step2", "layer_0_expert_0_mp_rank_00_model_states.pt"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"earlier")
    rc, res = consolidate_cli([ck, str(out)], capsys)
    assert rc == 2 and "layer_0_expert_0" in res.err
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == b"earlier"


def test_expert_files_in_a_zero3_checkpoint_are_refused(tmp_path):
    ck = copy_fixture(os.path.join(paths.DEEPSPEED_FIXTURES, "zero3_w2_fp32"), tmp_path)
    shutil.copy(os.path.join(EP2_W4, "global_step2", "layer_0_expert_0_mp_rank_00_model_states.pt"),
                os.path.join(ck, "global_step2"))
    with pytest.raises(DeepSpeedLayoutError, match="ZeRO-3"):
        DeepSpeedSource(ck)


def test_expert_optimizer_files_without_zero_are_refused(tmp_path):
    ck = copy_fixture(EP2_W4, tmp_path)
    open(os.path.join(ck, "global_step2", "expp_rank_0_mp_rank_00_optim_states.pt"), "wb").close()
    with pytest.raises(DeepSpeedLayoutError, match="expp_rank"):
        DeepSpeedSource(ck)


# -- AutoEP (ZeRO-3): the per-rank model states must agree -------------------------------------
AUTOEP_W4 = os.path.join(MOE, "zero3_autoep2_w4_fp32")


def _edit_autoep_layers(ck, rank, **values):
    path = os.path.join(ck, "global_step2", f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
    state = torch.load(path, weights_only=True)
    for layer in state["ds_autoep_layers"]:
        layer.update(values)
    torch.save(state, path)
    return path


def test_autoep_expert_counts_that_differ_between_rank_files(tmp_path, capsys):
    ck = copy_fixture(AUTOEP_W4, tmp_path)
    _edit_autoep_layers(ck, 1, num_experts=8)
    tag = os.path.join(ck, "global_step2")
    _refused(ck, tmp_path, capsys, os.path.join(tag, "zero_pp_rank_1_mp_rank_00_model_states.pt"),
             os.path.join(tag, "zero_pp_rank_0_mp_rank_00_model_states.pt"),
             "model.layers.0.mlp.experts.w1", "expert counts differ")


def test_autoep_ranks_of_one_partition_group_disagree_on_their_experts(tmp_path, capsys):
    ck = copy_fixture(AUTOEP_W4, tmp_path)
    _edit_autoep_layers(ck, 3, global_expert_start=0)  # rank 3 shares rank 1's experts 2-3
    _refused(ck, tmp_path, capsys, "zero_pp_rank_3_mp_rank_00_model_states.pt", "experts from 0",
             "same partition group")


def test_autoep_experts_no_rank_holds(tmp_path, capsys):
    ck = copy_fixture(AUTOEP_W4, tmp_path)
    for rank in range(4):
        _edit_autoep_layers(ck, rank, num_experts=6)
    _refused(ck, tmp_path, capsys, "model.layers.0.mlp.experts.w1", "experts 4..5 of 6")


def test_autoep_absurd_expert_count_is_refused_at_once(tmp_path, capsys):
    ck = copy_fixture(AUTOEP_W4, tmp_path)
    for rank in range(4):
        _edit_autoep_layers(ck, rank, num_experts=2 ** 62)
    _refused(ck, tmp_path, capsys, "model.layers.0.mlp.experts.w1", f"experts 4..5 of {2 ** 62}")


def test_autoep_other_expert_state_formats_are_refused(tmp_path, capsys):
    ck = copy_fixture(AUTOEP_W4, tmp_path)
    path = _edit_autoep_layers(ck, 0, checkpoint_format="per_expert_files")
    _refused(ck, tmp_path, capsys, path, "zero3_partitioned")
