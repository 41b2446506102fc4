"""One Hugging Face Trainer run with ZeroMuon (the recipe of docs/optimizer.md), for
tests/integration/test_hf_trainer.py; runs alone or under torchrun (DDP, gloo, CPU).

    python tests/helpers/hf_trainer_run.py OUT_DIR MAX_STEPS [RESUME_FROM]

Writes OUT_DIR/result-rank{r}.pt: the final parameters, the logged losses, and which
parameters ZeroMuon put on Muon.
"""

import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from offload_engine.optim.hf_trainer import TrainerZeroMuon


def dataset(n: int = 48, length: int = 16):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (n, length), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def main() -> None:
    out, max_steps = sys.argv[1], int(sys.argv[2])
    resume = sys.argv[3] if len(sys.argv) > 3 else None
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                       n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0))
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=4, max_steps=max_steps,
        learning_rate=3e-3, weight_decay=0.1, lr_scheduler_type="linear", warmup_steps=2,
        save_strategy="steps", save_steps=3, logging_steps=1, report_to=[], use_cpu=True,
        seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", 1)) > 1 else None)
    trainer = Trainer(model=model, args=args, train_dataset=dataset(),
                      optimizer_cls_and_kwargs=(TrainerZeroMuon(args), {}))
    trainer.train(resume_from_checkpoint=resume)
    opt = trainer.optimizer
    opt = getattr(opt, "optimizer", opt)  # accelerate wraps it
    muon = sorted(n for g in opt.param_groups if g["use_muon"] for n in g["param_names"])
    lrs = [g["lr"] for g in opt.param_groups]
    losses = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    rank = int(os.environ.get("RANK", 0))
    torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "losses": losses, "muon": muon, "lrs": lrs},
               os.path.join(out, f"result-rank{rank}.pt"))


def end_distributed() -> None:
    """Join gloo's worker threads while the interpreter is whole: the Trainer never
    destroys the process group it made, and a worker that drops the last reference to a
    finished all_gather (the Trainer's loss gather) during interpreter shutdown aborts the
    process ('terminate called without an active exception')."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    end_distributed()
