"""One Hugging Face Trainer run with ZeroMuon (TrainerZeroMuon) under ``accelerate launch``,
for tests/integration/test_accelerate_fsdp2.py.

    accelerate launch --config_file CFG.yaml tests/helpers/accelerate_trainer_run.py \
        OUT_DIR MAX_STEPS [RESUME_FROM | --fsdp2-by-hand]

``--fsdp2-by-hand`` applies ``fully_shard`` to each block and the root before the Trainer
sees the model (accelerate does not shard on CPU), and marks the model as sharded at load
time so the Trainer neither wraps it in DDP nor moves it; the Trainer then refuses to save
optimizer state, so that run saves nothing.

Writes OUT_DIR/result-rank{r}.pt: the final parameters, the logged losses, the logits of
the trained model on a fixed batch, and how accelerate ran the job (its distributed type,
whether the Trainer saw FSDP, whether any parameter is a sharded DTensor).
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from helpers.hf_trainer_run import dataset  # the same 48 rows as the plain Trainer test
from offload_engine.optim.hf_trainer import TrainerZeroMuon


def tiny_config() -> GPT2Config:
    """A 2-layer GPT-2 of width 32 over 64 tokens; no dropout, so runs repeat bit for bit."""
    return GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      bos_token_id=0, eos_token_id=0)


def probe_batch() -> torch.Tensor:
    """The fixed input whose logits the test compares (2 rows of 16 token ids)."""
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


def shard_by_hand(model: GPT2LMHeadModel) -> None:
    """FSDP2 over all ranks (gloo, CPU): each GPT-2 block, then the root."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # transformers' flag for a model sharded by from_pretrained(distributed_config=...): the
    # Trainer then skips its DDP wrap and device placement (a private attribute; no public one)
    model._is_distributed_loading_by_transformers = True


def main() -> None:
    out, max_steps = sys.argv[1], int(sys.argv[2])
    by_hand = sys.argv[3:] == ["--fsdp2-by-hand"]
    resume = None if by_hand or len(sys.argv) < 4 else sys.argv[3]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_config())
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=4, max_steps=max_steps,
        learning_rate=3e-3, weight_decay=0.1, lr_scheduler_type="linear", warmup_steps=2,
        save_strategy="no" if by_hand else "steps", save_steps=3, save_only_model=by_hand, logging_steps=1, report_to=[], use_cpu=True,
        seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True)
    if by_hand:
        if not dist.is_initialized():  # TrainingArguments has usually started it
            dist.init_process_group("gloo")
        shard_by_hand(model)
    trainer = Trainer(model=model, args=args, train_dataset=dataset(),
                      optimizer_cls_and_kwargs=(TrainerZeroMuon(args), {}))
    trainer.train(resume_from_checkpoint=resume)
    model.eval()
    with torch.no_grad():
        logits = model(probe_batch()).logits
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps it
    losses = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    rank = int(os.environ.get("RANK", 0))
    torch.save({"params": {n: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
                           for n, p in model.named_parameters()},
                "optimizer": type(opt).__name__,
                "losses": losses, "logits": logits,
                "distributed_type": trainer.accelerator.distributed_type.value,
                "fsdp": bool(trainer.is_fsdp_enabled),
                "dtensor": any(isinstance(p, DTensor) for p in model.parameters()),
                "world": int(os.environ.get("WORLD_SIZE", 1))},
               os.path.join(out, f"result-rank{rank}.pt"))


if __name__ == "__main__":
    main()
