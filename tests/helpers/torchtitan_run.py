"""torchtitan's components driving ZeroMuon, as torchtitan's Trainer wires them (torchrun).

    torchrun --nproc-per-node W tests/helpers/torchtitan_run.py --out DIR --steps N
             [--tp 2] [--save-at K --kill-after K2] [--resume]

The llama3 "debugmodel" from torchtitan's model registry (shrunk to --layers of its 6 layers
and a 256-token vocabulary; causal SDPA in place of flex attention, which has no backward on
CPU), meshes from torchtitan's ParallelDims, parallelized by torchtitan's own parallelize_llama
(FSDP over dp_shard, tensor parallel over tp), ZeroMuon built by
``ZeroMuonOptimizersContainer.Config.build`` (the call Trainer makes), an LR schedule from
LRSchedulersContainer, and checkpoints by torchtitan's CheckpointManager (DCP) in DIR/ckpt.
Trainer itself is not used: it cannot be imported here (docs/torchtitan.md, Limits).

Rank 0 appends "step loss.hex()" lines to DIR/losses-<tag>.txt. --save-at K saves at step K;
--kill-after K2 then SIGKILLs every rank after step K2 (after the save, so the steps between
are lost). --resume loads the latest checkpoint first (its store folder is reused with
stale_store="discard", as after a crash) and trains on from the step after it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal

import torch
import torch.distributed as dist

import torchtitan.distributed.parallel_dims as parallel_dims_module
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer, ParamGroupConfig
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.sharding import set_llama3_sharding_config
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from offload_engine.integrations.torchtitan import ZeroMuonOptimizersContainer

SEQ, BATCH, VOCAB = 16, 2, 256


class TrainState(Stateful):
    """The step counter, saved as torchtitan's Trainer saves its own ("train_state")."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state_dict):
        self.step = int(state_dict["step"])


def build_model(args, parallelism, parallel_dims, training):
    spec = model_registry("debugmodel", attn_backend="flex")
    config = spec.model
    config.layers = config.layers[: args.layers]
    # a 256-token vocabulary (2048 in debugmodel): the embedding and head are most of the
    # state otherwise, and the test moves it through the store every step
    config.vocab_size = config.tok_embeddings.num_embeddings = VOCAB
    config.lm_head.out_features = VOCAB
    for layer in config.layers:
        # RoPE cache sized to the sequence, as Trainer does
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=SEQ)
        # flex attention has no backward on CPU (torch 2.13); causal SDPA computes the same
        # attention for one document per sequence
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    # what Llama3Model.Config.update_from_config does for a non-Trainer config
    set_llama3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel)
    with torch.device("meta"):
        model = config.build()
    model = spec.parallelize_fn(model, parallel_dims=parallel_dims, training=training,
                                parallelism=parallelism, compile_config=CompileConfig(),
                                ac_config=None, dump_folder=args.out)
    # parallelize_llama sets FSDP's gradient divide factor to 1.0, which FSDP sends as
    # ReduceOp.PREMUL_SUM, and gloo has no PREMUL_SUM: reduce with a plain SUM instead (the
    # same sum; the loss is divided by the data-parallel degree below, as Trainer divides by
    # the global token count)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)  # every run starts from the same weights
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model, config.vocab_size


def optimizer_config(store_dir: str) -> ZeroMuonOptimizersContainer.Config:
    return ZeroMuonOptimizersContainer.Config(
        param_groups=[ParamGroupConfig(
            pattern=r".*", optimizer_name="ZeroMuon",
            optimizer_kwargs={"lr": 0.02, "weight_decay": 0.1,
                              "adamw": {"lr": 3e-3, "weight_decay": 0.01}})],
        implementation="for-loop",
        optimizer_factory_kwargs_by_name={"ZeroMuon": {
            # about half of a rank's state fits the pinned budget: the rest streams
            "store": {"nvme_paths": [store_dir], "bucket_bytes": "64KiB",
                      "cpu_budget": "2MiB"},
            "stale_store": "discard"}})


def batch(step: int, vocab: int, dp_rank: int):
    # counting sequences from random starts among the first 64 tokens: learnable in a few
    # steps, so the loss falls
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    starts = torch.randint(0, 64, (BATCH, 1), generator=g)
    tokens = (starts + torch.arange(SEQ + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--kill-after", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--tag", required=True)
    return p.parse_args()


def train_step(model, optimizers, lr_schedulers, step, vocab, parallel_dims) -> float:
    """One step as Trainer takes it; returns the loss averaged over data-parallel ranks."""
    loss_mesh = parallel_dims.get_mesh("loss")
    inputs, labels = batch(step, vocab, parallel_dims.get_mesh("batch").get_local_rank())
    optimizers.zero_grad()
    positions = torch.arange(SEQ).expand(BATCH, SEQ)  # one document per sequence
    logits = model(inputs, positions=positions)
    if isinstance(logits, DTensor):  # tensor parallel: the head's output is sharded
        logits = logits.full_tensor()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    (loss / loss_mesh.size()).backward()
    optimizers.step()
    lr_schedulers.step()
    total = loss.detach().clone()
    dist.all_reduce(total, group=loss_mesh.get_group())
    return total.item() / loss_mesh.size()


def main():
    args = parse_args()
    dist.init_process_group("gloo")
    # torchtitan takes "cuda" as the device when it finds no accelerator; the mesh is CPU here
    parallel_dims_module.device_type = "cpu"
    parallelism = ParallelismConfig(tensor_parallel_degree=args.tp,
                                    spmd_backend="partial_dtensor")
    # torchtitan's default mixed precision: bf16 parameters in compute, fp32 gradient reduction
    training = TrainingConfig(local_batch_size=BATCH, seq_len=SEQ, steps=args.steps)
    parallel_dims = ParallelDims.from_config(parallelism, dist.get_world_size())
    parallel_dims.build_mesh()

    model, vocab = build_model(args, parallelism, parallel_dims, training)
    optimizers = optimizer_config(os.path.join(args.out, "store")).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=args.steps)
    train_state = TrainState()
    checkpointer = CheckpointManager.Config(
        enable=True, folder="ckpt", interval=1, last_save_model_only=False).build(
        dataloader=None, model_parts=[model], optimizers=optimizers,
        lr_schedulers=lr_schedulers, states={"train_state": train_state}, sd_adapter=None,
        base_folder=args.out)
    if args.resume:
        assert checkpointer.load(step=-1), "no checkpoint to resume from"

    losses = os.path.join(args.out, f"losses-{args.tag}.txt")
    while train_state.step < args.steps:
        train_state.step += 1
        loss = train_step(model, optimizers, lr_schedulers, train_state.step, vocab,
                          parallel_dims)
        if dist.get_rank() == 0:
            with open(losses, "a") as f:
                f.write(f"{train_state.step} {loss.hex()}\n")
        if train_state.step == args.save_at:
            checkpointer.save(curr_step=train_state.step)
        if train_state.step == args.kill_after:
            dist.barrier()  # every rank past the save and this step, then a crash
            os.kill(os.getpid(), signal.SIGKILL)
    optimizers.close()
    checkpointer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
