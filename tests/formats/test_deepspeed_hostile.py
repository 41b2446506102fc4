"""DeepSpeed metadata that declares impossible shapes is refused with DeepSpeedLayoutError
before its numbers are multiplied or allocated."""

import os

import pytest
import torch

from offload_engine.formats.deepspeed import DeepSpeedSource
from offload_engine.formats.deepspeed.files import DeepSpeedLayoutError


def _zero2_checkpoint(root, param_shapes, frozen_param_shapes=None, numel=10, zero_stage=2,
                      buffer_names=[], module=None, paddings=None, osd_extra={}, model_extra={}):
    """A minimal one-rank ZeRO-2 checkpoint written with torch.save (plain containers)."""
    tag = os.path.join(root, "global_step1")
    os.makedirs(tag)
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("global_step1")
    torch.save({"optimizer_state_dict": {"zero_stage": zero_stage, "partition_count": 1,
                                         "single_partition_of_fp32_groups": [torch.zeros(numel)],
                                         "base_optimizer_state": {"state": {}, "param_groups": []},
                                         **({} if paddings is None else
                                            {"param_alignment_paddings": paddings}), **osd_extra}},
               os.path.join(tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    model = {"module": {} if module is None else module, "param_shapes": param_shapes, "buffer_names": buffer_names}
    model.update(model_extra)
    if frozen_param_shapes is not None:
        model["frozen_param_shapes"] = frozen_param_shapes
    torch.save(model, os.path.join(tag, "mp_rank_00_model_states.pt"))
    return root


def test_minimal_checkpoint_reads(tmp_path):
    # the builder makes a readable checkpoint: what the refusals below differ from
    with DeepSpeedSource(_zero2_checkpoint(str(tmp_path), [{"w": torch.Size([2, 5])}])) as src:
        assert [(t.name, t.shape) for t in src.tensors()] == [("w", (2, 5))]


@pytest.mark.parametrize("shapes, words", [
    ([{"w": "abc"}], "param_shapes['w'] has shape 'abc'"),
    ([{"w": [2, -5]}], "param_shapes['w'] has shape [2, -5]"),
    ([{"w": [2**64]}], "param_shapes['w'] has shape"),
    ([{"w": [1] * 65}], "expected at most 64 integers"),
    (7, "'param_shapes' is 7, expected a dict"),
    ([{3: [10]}], "a parameter name that is not a string"),
])
def test_impossible_param_shapes_are_refused(tmp_path, shapes, words):
    root = _zero2_checkpoint(str(tmp_path), shapes)
    with pytest.raises(DeepSpeedLayoutError, match="mp_rank_00_model_states.pt: ") as e:
        DeepSpeedSource(root)
    assert words in str(e.value)


def test_impossible_frozen_param_shapes_are_refused(tmp_path):
    root = _zero2_checkpoint(str(tmp_path), [{"w": torch.Size([10])}], frozen_param_shapes={"f": "xy"})
    with pytest.raises(DeepSpeedLayoutError, match=r"frozen_param_shapes\['f'\] has shape 'xy'"):
        DeepSpeedSource(root)


def test_shape_bigger_than_the_partitions_is_refused(tmp_path):
    # 10**12 elements declared, 10 stored: refused before anything of that size exists
    root = _zero2_checkpoint(str(tmp_path), [{"w": torch.Size([10**6, 10**6])}])
    with pytest.raises(DeepSpeedLayoutError, match="partitions do not match the parameter shapes"):
        DeepSpeedSource(root)


BIG = ["x" * 1000] * 100_000  # 3 bytes of pickle per item (memo references); 100 MB as a repr


@pytest.mark.parametrize("where", ["zero_stage", "buffer_names"])
def test_error_messages_do_not_repr_huge_values(tmp_path, where):
    # an error message quoted the offending value whole: a few MB of pickle referring to one
    # string many times made a repr of any size (here 100 MB)
    root = _zero2_checkpoint(str(tmp_path), [{"w": torch.Size([10])}],
                             **({"zero_stage": BIG} if where == "zero_stage" else {"buffer_names": [BIG]}))
    with pytest.raises(DeepSpeedLayoutError) as e:
        DeepSpeedSource(root)
    assert len(str(e.value)) < 1000


@pytest.mark.parametrize("names", [[["b"]], "buf", [3]])
def test_buffer_names_not_a_list_of_names_is_refused(tmp_path, names):
    # a list among the names crashed with TypeError (unhashable) where the module was looked up
    root = _zero2_checkpoint(str(tmp_path), [{"w": torch.Size([10])}], buffer_names=names)
    with pytest.raises(DeepSpeedLayoutError, match="'buffer_names' is .*expected a list of names"):
        DeepSpeedSource(root)


def test_module_not_a_dict_is_refused(tmp_path):
    # a list as 'module' crashed with AttributeError where buffers were looked up
    root = _zero2_checkpoint(str(tmp_path), [{"w": torch.Size([10])}], buffer_names=["b"], module=[1])
    with pytest.raises(DeepSpeedLayoutError, match="not a DeepSpeed model states file"):
        DeepSpeedSource(root)


@pytest.mark.parametrize("pads", [["x"], [[0, "x"]], [[-1]], 5])
def test_alignment_paddings_not_counts_are_refused(tmp_path, pads):
    # found by tests/helpers/fuzz_readers.py: a string among the paddings crashed with TypeError
    root = _zero2_checkpoint(str(tmp_path), [{"w": torch.Size([10])}], paddings=pads)
    with pytest.raises(DeepSpeedLayoutError, match="'param_alignment_paddings' is .*expected a list"):
        DeepSpeedSource(root)


def test_alignment_paddings_of_zeros_still_read(tmp_path):
    root = _zero2_checkpoint(str(tmp_path), [{"w": torch.Size([10])}], paddings=[[0]])
    with DeepSpeedSource(root) as src:
        assert [t.name for t in src.tensors()] == ["w"]


def test_empty_partition_count_is_refused(tmp_path):
    # max() of no counts raised a bare ValueError
    root = _zero2_checkpoint(str(tmp_path), [{"w": torch.Size([10])}], osd_extra={"partition_count": []})
    with pytest.raises(DeepSpeedLayoutError, match="partition_count is .*expected an integer"):
        DeepSpeedSource(root)


def test_optimizer_state_of_a_group_that_is_not_a_dict_is_skipped(tmp_path):
    # a list where a group's state dict belongs crashed with AttributeError; the moments
    # are then simply not there
    root = _zero2_checkpoint(str(tmp_path), [{"w": torch.Size([10])}],
                             osd_extra={"base_optimizer_state": {"state": {0: [1]}, "param_groups": 5}})
    with DeepSpeedSource(root) as src:
        assert list(src.tensors()[0].states) == ["master"]


def test_huge_ds_version_is_shown_bounded(tmp_path):
    root = _zero2_checkpoint(str(tmp_path), [{"w": torch.Size([10])}], model_extra={"ds_version": BIG})
    with DeepSpeedSource(root) as src:
        assert len(src.info.format) < 1000 and len(src.describe()) < 2000
