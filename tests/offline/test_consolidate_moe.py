"""consolidate of grouped expert stacks: the per-expert names Hugging Face writes, bit for bit.

The reference is transformers 5.25 itself: ``save_pretrained`` of a tiny Qwen3-MoE and a
tiny Mixtral (built in code) writes one 2-D weight per expert while the model holds them
fused ([E, 2I, H] gate then up rows, [E, H, I]). Our input is the model's own state dict
(fused, as a training run checkpoints it) with its config.json beside it; consolidate
must write exactly what save_pretrained writes, which from_pretrained loads into the same
logits. Bad expert stacks are refused in one line, before anything is written.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from offload_engine.cli.main import main
from offload_engine.errors import InputError
from offload_engine.offline.consolidate import consolidate
from offload_engine.offline.hf_experts import PerExpertSource, stack_pieces

from helpers.consolidate_outputs import DictSource, load_output
from helpers.moe_models import logits, tiny_mixtral, tiny_qwen3_moe


def fused_checkpoint(model, folder) -> str:
    """The model's own (fused) state dict as model.safetensors, config.json beside it."""
    os.makedirs(folder)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("build", [tiny_qwen3_moe, tiny_mixtral], ids=["qwen3_moe", "mixtral"])
def test_consolidate_writes_what_save_pretrained_writes(tmp_path, build, capsys):
    model = build(seed=1)
    model.save_pretrained(tmp_path / "hf")
    want = load_file(tmp_path / "hf" / "model.safetensors")
    assert any(".experts.3." in k for k in want)  # 5.25 writes per-expert names

    src = fused_checkpoint(model, tmp_path / "fused")
    assert main(["consolidate", src, str(tmp_path / "out"), "--verify", "--max-shard-size",
                 "20KB"]) == 0
    assert "written per expert" in capsys.readouterr().out
    got, _ = load_output(tmp_path / "out")
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert got[name].dtype == w.dtype and torch.equal(got[name], w), name

    loaded, info = type(model).from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert torch.equal(logits(loaded), logits(model))


def test_grouped_keeps_the_stacks_as_stored(tmp_path, capsys):
    model = tiny_qwen3_moe(seed=2)
    src = fused_checkpoint(model, tmp_path / "fused")
    assert main(["consolidate", src, str(tmp_path / "out"), "--experts", "grouped"]) == 0
    assert "grouped expert stacks written as stored (--experts grouped)" in capsys.readouterr().out
    got, _ = load_output(tmp_path / "out")
    stack = "model.layers.1.mlp.experts.gate_up_proj"
    assert torch.equal(got[stack], model.state_dict()[stack])
    # without a config.json, auto keeps them grouped too, and says why
    os.remove(os.path.join(src, "config.json"))
    assert main(["consolidate", src, str(tmp_path / "out2")]) == 0
    assert "no config.json beside the checkpoint" in capsys.readouterr().out
    assert stack in load_output(tmp_path / "out2")[0]


def test_torchtitan_stacks_split_by_the_generic_rule(tmp_path):
    """Our own grouped layout (torchtitan: w1 [E, F, D], w2 [E, D, F], w3 [E, F, D]):
    ``P.experts.N`` -> ``P.experts.{e}.N.weight``, slice e, bit for bit."""
    g = torch.Generator().manual_seed(0)
    data = {"layers.0.moe.experts.w1": torch.randn(3, 6, 4, generator=g),
            "layers.0.moe.experts.w2": torch.randn(3, 4, 6, generator=g),
            "layers.0.moe.experts.w3": torch.randn(3, 6, 4, generator=g),
            "layers.0.moe.router.gate.weight": torch.randn(3, 4, generator=g),
            "norm.weight": torch.randn(4, generator=g)}
    consolidate(PerExpertSource(DictSource(data)), str(tmp_path / "out"))
    got, _ = load_output(tmp_path / "out")
    assert len(got) == 2 + 3 * 3
    for e in range(3):
        for w in ("w1", "w2", "w3"):
            assert torch.equal(got[f"layers.0.moe.experts.{e}.{w}.weight"],
                               data[f"layers.0.moe.experts.{w}"][e])
    assert torch.equal(got["norm.weight"], data["norm.weight"])


def test_each_piece_is_one_contiguous_range():
    """What makes the output stream: every per-expert tensor is one range of its stack."""
    pieces = stack_pieces("m.mlp.experts.gate_up_proj", (4, 10, 3), "qwen2_moe")
    assert [(p.name, p.start, p.shape) for p in pieces[:3]] == [
        ("m.mlp.experts.0.gate_proj.weight", 0, (5, 3)),
        ("m.mlp.experts.0.up_proj.weight", 15, (5, 3)),
        ("m.mlp.experts.1.gate_proj.weight", 30, (5, 3))]
    mixtral = stack_pieces("m.mlp.experts.down_proj", (4, 3, 5), "mixtral")
    assert mixtral[3].name == "m.block_sparse_moe.experts.3.w2.weight" and mixtral[3].start == 45


# -- bad input: one line naming the file or tensor, nothing written ------------------------------
def _refused(tmp_path, src, capsys, *extra) -> str:
    out = tmp_path / "out"
    assert main(["consolidate", str(src), str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert not out.exists() or not os.listdir(out)
    return err


def test_expert_counts_that_differ_are_refused(tmp_path, capsys):
    model = tiny_qwen3_moe(seed=3)
    src = fused_checkpoint(model, tmp_path / "fused")
    sd = load_file(os.path.join(src, "model.safetensors"))
    down = "model.layers.0.mlp.experts.down_proj"
    # the down stack in a second file, with one expert fewer
    save_file({down: sd.pop(down)[:4].contiguous()}, os.path.join(src, "model-00002-of-00002.safetensors"))
    save_file(sd, os.path.join(src, "model-00001-of-00002.safetensors"))
    os.remove(os.path.join(src, "model.safetensors"))
    weight_map = {k: "model-00001-of-00002.safetensors" for k in sd}
    weight_map[down] = "model-00002-of-00002.safetensors"
    with open(os.path.join(src, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    err = _refused(tmp_path, src, capsys)
    assert down in err and "holds 4 experts" in err and "gate_up_proj holds 5" in err


def test_config_that_contradicts_the_stacks_is_refused(tmp_path, capsys):
    src = fused_checkpoint(tiny_qwen3_moe(seed=4), tmp_path / "fused")
    config = json.load(open(os.path.join(src, "config.json")))
    config["num_experts"] = 6
    json.dump(config, open(os.path.join(src, "config.json"), "w"))
    err = _refused(tmp_path, src, capsys)
    assert "config.json declares 6 experts" in err and "holds 5" in err


def test_fused_stack_with_odd_rows_is_refused(tmp_path):
    data = {"l.mlp.experts.gate_up_proj": torch.zeros(2, 5, 3),
            "l.mlp.experts.down_proj": torch.zeros(2, 3, 2)}
    with pytest.raises(InputError, match=r"l\.mlp\.experts\.gate_up_proj \[2, 5, 3\] is not a fused"):
        PerExpertSource(DictSource(data))
    data = {"l.mlp.experts.gate_up_proj": torch.zeros(2, 6, 3),
            "l.mlp.experts.down_proj": torch.zeros(2, 3, 4)}
    with pytest.raises(InputError, match="does not match"):
        PerExpertSource(DictSource(data))


def test_experts_both_grouped_and_per_expert_are_refused(tmp_path):
    data = {"l.experts.w1": torch.zeros(2, 3, 4), "l.experts.0.w1.weight": torch.zeros(3, 4)}
    with pytest.raises(InputError, match=r"l\.experts\.0\.w1\.weight would be written twice"):
        PerExpertSource(DictSource(data))


def test_auto_keeps_stacks_of_an_unknown_model_type(tmp_path, capsys):
    """A model_type without a per-expert naming here (gpt_oss keeps its experts grouped and
    interleaved) is written as stored; --experts grouped does not even read config.json."""
    src = fused_checkpoint(tiny_qwen3_moe(seed=5), tmp_path / "fused")
    config = json.load(open(os.path.join(src, "config.json")))
    json.dump({**config, "model_type": "gpt_oss"}, open(os.path.join(src, "config.json"), "w"))
    assert main(["consolidate", src, str(tmp_path / "out"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "model_type 'gpt_oss' has no per-expert naming here" in report["experts"]
    assert "model.layers.0.mlp.experts.gate_up_proj" in load_output(tmp_path / "out")[0]
    with open(os.path.join(src, "config.json"), "w") as f:
        f.write("{not json")
    assert main(["consolidate", src, str(tmp_path / "out2"), "--experts", "grouped",
                 "--no-copy-config"]) == 0
    err = _refused(tmp_path / "again", src, capsys)  # auto reads it: one line naming it
    assert "config.json: not valid JSON" in err


@pytest.mark.parametrize("experts", [4, 512])
def test_memory_does_not_grow_with_the_number_of_experts(tmp_path, experts):
    """One expert slice at a time: the I/O buffers in use stay within the window pool
    whatever E (512 experts of 4 KiB each through 16 KiB windows)."""
    data = {"l.mlp.experts.gate_up_proj": torch.randn(experts, 16, 32),
            "l.mlp.experts.down_proj": torch.randn(experts, 32, 8)}
    window = 16 * 1024
    result = consolidate(PerExpertSource(DictSource(data)), str(tmp_path / "out"),
                         window_bytes=window)
    assert result.tensors == 3 * experts
    assert result.peak_buffer_bytes <= 5 * window
    got, _ = load_output(tmp_path / "out")
    assert torch.equal(got[f"l.mlp.experts.{experts - 1}.up_proj.weight"],
                       data["l.mlp.experts.gate_up_proj"][-1, 8:])
