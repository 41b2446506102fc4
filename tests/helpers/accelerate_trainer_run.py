"""One Hugging Face Trainer run with ZeroMuon under ``accelerate launch``, for
tests/integration/test_accelerate_fsdp2.py.

    accelerate launch --config_file CFG.yaml tests/helpers/accelerate_trainer_run.py \
        OUT_DIR MAX_STEPS [--fsdp2 | --fsdp2-by-hand] [--resume CHECKPOINT]

Without a flag: the plain Trainer with ``TrainerZeroMuon`` (accelerate runs the FSDP2
config as DDP on CPU), saving the Trainer's own ``optimizer.pt``.

``--fsdp2``: the model sharded with FSDP2 at load time by transformers
(``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=WORLD))``, each GPT-2
block and the root; accelerate does not shard on CPU), and ``ZeroMuonTrainer``, which saves
our checkpoint into each ``checkpoint-<step>`` folder and resumes from it.
``--fsdp2-by-hand``: the same with ``fully_shard`` applied by hand instead.

Both save every 3 steps. Writes OUT_DIR/result-rank{r}.pt: the final parameters (gathered),
the logged losses, the logits of the trained model on a fixed batch, and how accelerate ran
the job (its distributed type, whether the Trainer saw FSDP, whether any parameter is a
sharded DTensor).
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.distributed import DistributedConfig

from helpers.hf_trainer_run import dataset, end_distributed  # the plain Trainer test's rows
from offload_engine.integrations.hf_trainer import ZeroMuonTrainer
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


def load_sharded(folder: str) -> GPT2LMHeadModel:
    """The seed-0 tiny model, written to ``folder`` by rank 0, loaded back by every rank as
    FSDP2 shards (transformers' own sharding at load time: each block, then the root)."""
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        GPT2LMHeadModel(tiny_config()).save_pretrained(folder)
    dist.barrier()
    plan = {"transformer.h.*": "free_full_weight"}  # GPT-2's blocks (the default plan is Llama's)
    return GPT2LMHeadModel.from_pretrained(folder, distributed_config=DistributedConfig(
        fsdp_size=dist.get_world_size(), fsdp_plan=plan))


def main() -> None:
    cli = argparse.ArgumentParser()
    cli.add_argument("out")
    cli.add_argument("max_steps", type=int)
    cli.add_argument("--fsdp2", action="store_true")
    cli.add_argument("--fsdp2-by-hand", action="store_true")
    cli.add_argument("--resume")
    a = cli.parse_args()
    args = TrainingArguments(
        output_dir=a.out, per_device_train_batch_size=4, max_steps=a.max_steps,
        learning_rate=3e-3, weight_decay=0.1, lr_scheduler_type="linear", warmup_steps=2,
        save_strategy="steps", save_steps=3, logging_steps=1, report_to=[], use_cpu=True,
        seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True)
    if not dist.is_initialized():  # TrainingArguments has usually started it
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_config())
    if a.fsdp2:
        model = load_sharded(os.path.join(a.out, "initial-model"))
    elif a.fsdp2_by_hand:
        shard_by_hand(model)
    if a.fsdp2 or a.fsdp2_by_hand:
        trainer = ZeroMuonTrainer(model=model, args=args, train_dataset=dataset())
    else:
        trainer = Trainer(model=model, args=args, train_dataset=dataset(),
                          optimizer_cls_and_kwargs=(TrainerZeroMuon(args), {}))
    trainer.train(resume_from_checkpoint=a.resume)
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
               os.path.join(a.out, f"result-rank{rank}.pt"))


if __name__ == "__main__":
    main()
    end_distributed()
