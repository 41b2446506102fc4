"""ZeroMuonTrainer in one process: each Trainer checkpoint folder holds our checkpoint, a
resume from it continues bit for bit, and consolidate of it loads with from_pretrained; the
Trainer's refusal to checkpoint a model sharded at load time is lifted only while the
Trainer is built. (2 processes under accelerate launch: test_accelerate_fsdp2.py.)"""

import os

import pytest
import torch

pytest.importorskip("accelerate", reason="the Trainer needs accelerate (a test dependency)")
transformers = pytest.importorskip("transformers")

from helpers.accelerate_trainer_run import tiny_config  # noqa: E402 (after the skips)
from helpers.hf_trainer_run import dataset  # noqa: E402
from offload_engine.cli.main import main as cli_main  # noqa: E402
from offload_engine.integrations.hf_trainer import ZeroMuonTrainer  # noqa: E402
from offload_engine.optim import ZeroMuon  # noqa: E402


def arguments(out, max_steps=4, **overrides):
    return transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, max_steps=max_steps,
        learning_rate=3e-3, weight_decay=0.1, lr_scheduler_type="linear", warmup_steps=2,
        save_strategy="steps", save_steps=2, logging_steps=1, report_to=[], use_cpu=True,
        seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True, **overrides)


def train(out, resume=None):
    """A 4-step run saving at steps 2 and 4; its losses and final parameters."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(tiny_config())
    trainer = ZeroMuonTrainer(model=model, args=arguments(out), train_dataset=dataset())
    trainer.train(resume_from_checkpoint=resume)
    assert isinstance(trainer.optimizer.optimizer, ZeroMuon)  # the default optimizer
    trainer.optimizer.optimizer.close()
    losses = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_saves_resumes_bit_for_bit_and_consolidates(tmp_path):
    out = tmp_path / "out"
    losses, params = train(out)
    checkpoint = out / "checkpoint-2"
    assert (checkpoint / "latest").read_text().strip() == "step-00000002"
    assert not (checkpoint / "optimizer.pt").exists()  # the state is in our generation
    # resumed into the same output_dir: checkpoint-4 is saved again, over the first run's
    resumed_losses, resumed = train(out, resume=str(checkpoint))
    assert len(losses) == 4 and resumed_losses == losses
    for name, p in params.items():
        assert torch.equal(p, resumed[name]), name
    assert sorted(os.listdir(out / "checkpoint-4")).count("step-00000004") == 1
    merged = tmp_path / "merged"
    assert cli_main(["consolidate", str(out / "checkpoint-4"), str(merged)]) == 0
    loaded = transformers.GPT2LMHeadModel.from_pretrained(merged)
    for name, p in loaded.named_parameters():
        assert torch.equal(p, params[name]), name


def test_refusal_for_a_model_sharded_at_load_time_is_lifted_only_while_building(tmp_path):
    model = transformers.GPT2LMHeadModel(tiny_config())
    model._is_distributed_loading_by_transformers = True  # as from_pretrained(distributed_config)
    args = arguments(tmp_path)
    with pytest.raises(ValueError, match="sharded at load time"):  # the Trainer's own refusal
        transformers.Trainer(model=model, args=args, train_dataset=dataset())
    ZeroMuonTrainer(model=model, args=args, train_dataset=dataset())
    assert args.save_only_model is False  # so the Trainer calls our optimizer save
    only_model = arguments(tmp_path, save_only_model=True)
    ZeroMuonTrainer(model=model, args=only_model, train_dataset=dataset())
    assert only_model.save_only_model is True  # the user's choice stays
