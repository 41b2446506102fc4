#!/usr/bin/env python3
"""Make the DeepSpeed 0.19.8 mixture-of-experts checkpoints under tests/fixtures/deepspeed_moe/.

Run with an interpreter that has deepspeed 0.19.8 (never this project's venv: deepspeed is
not a dependency); it starts its own ranks with ``torch.distributed.run``:

    DS_ACCELERATOR=cpu /work/dsvenv/bin/python tools/make_deepspeed_moe_fixtures.py [--out DIR] [RUN ...]

``--out DIR`` writes the runs under DIR instead of the fixtures folder (the suite's smoke
test does, to check the tool still makes what the reader reads).

Each run builds ``TinyMoE`` (two ``deepspeed.moe.layer.MoE`` layers of 4 experts, top-2
and top-1 gates), splits its parameters into dense and expert param groups with
``split_params_into_different_moe_groups_for_optimizer`` (what DeepSpeed's ZeRO-1/2
requires of an MoE model), trains two steps of a client ``torch.optim.AdamW`` on CPU
(gloo), and saves ``global_step2``. Right after saving it records, per parameter under its
checkpoint name (global expert ids), what DeepSpeed itself holds: the fp32 master
(``safe_get_full_fp32_param``) and both Adam moments (the moment fragments summed over the
parameter's own data-parallel group: the expert data-parallel group for experts), in
``expected.safetensors`` as ``<state>/<name>``, and the run's facts in ``run.json``.

The ``zero3_autoep*`` runs use DeepSpeed's AutoEP instead (native MoE is refused under
ZeRO-3): a tiny transformers Qwen3-MoE whose MoE blocks AutoEP replaces by grouped experts
``experts.w1/w2/w3`` [experts on the rank, out, in], trained the same way at ZeRO-3; the
expected tensors are the expert-parallel ranks' experts stacked by global id,
[num_experts, out, in]. One DeepSpeed function is replaced for them (see
``autoep_rank_main``): DeepSpeed 0.19.8's AutoEP fails at ``initialize`` against
transformers 5.25 otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "deepspeed_moe")
RUNS = {
    # name: (ZeRO stage, expert-parallel size, world size, bf16)
    "zero1_ep1_w2_fp32": (1, 1, 2, False),
    "zero2_ep2_w2_fp32": (2, 2, 2, False),
    "zero2_ep2_w4_fp32": (2, 2, 4, False),
    "zero2_ep2_w4_fp32_datafirst": (2, 2, 4, False),
    "zero2_ep2_w2_bf16": (2, 2, 2, True),
}
# runs with ``use_data_before_expert_parallelism``: expert data-parallel groups of
# consecutive ranks (ranks 0-1 hold experts 0-1, ranks 2-3 experts 2-3)
DATA_FIRST = {"zero2_ep2_w4_fp32_datafirst"}
AUTOEP_RUNS = {
    # name: (expert-parallel size, world size): AutoEP on a tiny Qwen3-MoE, ZeRO-3, fp32
    "zero3_autoep2_w2_fp32": (2, 2),
    "zero3_autoep2_w4_fp32": (2, 4),
}
NUM_EXPERTS = 4
VOCAB, DIM = 19, 8
TAG = "global_step2"
_EXPERT = ".deepspeed_moe.experts.deepspeed_experts."


def build_model(ep_size: int):
    import torch
    from torch import nn
    from deepspeed.moe.layer import MoE

    class Expert(nn.Module):
        def __init__(self, dim: int, hidden: int):
            super().__init__()
            self.w1 = nn.Linear(dim, hidden)
            self.w2 = nn.Linear(hidden, dim, bias=False)

        def forward(self, x):
            return self.w2(torch.nn.functional.gelu(self.w1(x)))

    class TinyMoE(nn.Module):
        """Embedding, an MoE layer of 4 experts (top-2), a norm, a second MoE layer of 4
        smaller experts (top-1), an untied head, a float buffer."""

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.moe0 = MoE(DIM, Expert(DIM, 12), num_experts=NUM_EXPERTS, ep_size=ep_size, k=2,
                            capacity_factor=2.0, min_capacity=4, drop_tokens=False)
            self.norm = nn.LayerNorm(DIM)
            self.moe1 = MoE(DIM, Expert(DIM, 6), num_experts=NUM_EXPERTS, ep_size=ep_size, k=1,
                            capacity_factor=2.0, min_capacity=4, drop_tokens=False)
            self.head = nn.Linear(DIM, VOCAB, bias=False)
            self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))

        def forward(self, x, y):
            h = self.embed(x)
            out, aux0, _ = self.moe0(h)
            h = h + out
            out, aux1, _ = self.moe1(self.norm(h))
            h = h + out
            logits = self.head(h * self.scale.to(h.dtype))
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, VOCAB), y.view(-1))
            return loss + 0.01 * (aux0 + aux1)

    torch.manual_seed(0)
    return TinyMoE()


def batch(step: int, rank: int):
    import torch
    g = torch.Generator().manual_seed(100 + 10 * step + rank)
    return torch.randint(0, VOCAB, (2, 6), generator=g), torch.randint(0, VOCAB, (2, 6), generator=g)


def global_name(name: str, ep_rank: int, num_local: int) -> str:
    """The checkpoint's name of a parameter: an expert's local id becomes its global id."""
    if _EXPERT not in name:
        return name
    head, tail = name.split(_EXPERT, 1)
    local, rest = tail.split(".", 1)
    return f"{head}{_EXPERT}{ep_rank * num_local + int(local)}.{rest}"


def rank_main(name: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import groups, safe_get_full_fp32_param

    stage, ep_size, world, bf16 = RUNS[name]
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    model = build_model(ep_size)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 9}
    if name in DATA_FIRST:
        cfg["use_data_before_expert_parallelism"] = True
    if bf16:
        cfg["bf16"] = {"enabled": True}
    groups_in = [{"params": [p for p in model.parameters()], "name": "all", "weight_decay": 0.01}]
    opt = torch.optim.AdamW(split_params_into_different_moe_groups_for_optimizer(groups_in),
                            lr=0.01, betas=(0.9, 0.98), eps=1e-8)
    eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    rank = dist.get_rank()
    for step in range(2):
        x, y = batch(step, rank)
        loss = eng(x, y)
        eng.backward(loss)
        eng.step()
    eng.save_checkpoint(out, tag=TAG)

    group_name = f"ep_size_{ep_size}"
    ep_rank = groups._get_expert_parallel_rank(group_name)
    num_local = NUM_EXPERTS // ep_size
    inner = eng.optimizer.optimizer

    def moment(p, key):
        """The full moment of ``p``: its fragment in this rank's flat partition, summed over
        the parameter's data-parallel group (safe_get_full_optimizer_state raises on a last
        rank whose moments keep tail padding)."""
        buf = torch.zeros(p.numel(), dtype=torch.float32)
        m = p._hp_mapping
        if m is not None:
            flat = eng.optimizer.single_partition_of_fp32_groups[m.param_group_index]
            state = inner.state[flat][key]
            hp, lp = m.hp_fragment_address, m.lp_fragment_address
            buf.narrow(0, lp.start, lp.numel).copy_(state.narrow(0, hp.start, hp.numel))
        dist.all_reduce(buf, group=p._dp_group)
        return buf.view(p.shape)

    mine = {}
    for pname, p in model.named_parameters():
        gname = global_name(pname, ep_rank, num_local)
        mine[f"master/{gname}"] = safe_get_full_fp32_param(p).float().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            mine[f"{key}/{gname}"] = moment(p, key)
    everyone = [None] * world
    dist.all_gather_object(everyone, {k: v.numpy() for k, v in mine.items()})
    if rank == 0:
        from safetensors.torch import save_file
        merged = {}
        for got in everyone:
            for k, v in got.items():
                t = torch.from_numpy(v)
                if k in merged and not torch.equal(merged[k], t):
                    raise SystemExit(f"{k}: ranks disagree on DeepSpeed's own value")
                merged[k] = t
        save_file({k: v.contiguous() for k, v in sorted(merged.items())},
                  os.path.join(out, "expected.safetensors"), metadata={"format": "pt"})
        facts = {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                 "zero_stage": stage, "ep_size": ep_size, "world_size": world, "bf16": bf16,
                 "num_experts": NUM_EXPERTS, "config": cfg,
                 "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                  for g in opt.param_groups]}
        with open(os.path.join(out, "run.json"), "w") as f:
            json.dump(facts, f, indent=1, default=str)
    dist.barrier()


def build_qwen3_moe():
    """A tiny transformers Qwen3-MoE (2 layers, each an MoE of 4 experts, top-2), built
    from a config in code (no downloads)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=16, hidden_size=8, intermediate_size=12,
                         moe_intermediate_size=4, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=4, num_experts=NUM_EXPERTS,
                         num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg)


def autoep_rank_main(name: str, out: str) -> None:
    """AutoEP (``expert_parallel`` in the config) replaces each Qwen3-MoE block by a layer
    with grouped experts ``experts.w1/w2/w3`` [experts on this rank, out, in]; ZeRO-3
    partitions them over the expert data-parallel group."""
    import torch
    import torch.distributed as dist
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    # DeepSpeed 0.19.8's AutoEP preset re-registers transformers' output recorders with
    # ``registry.get(key, default)``, which transformers 5.25's _CanRecordRegistry does not
    # take (TypeError at initialize). The recorders only capture router logits for
    # ``output_router_logits``; skipping them leaves training and the checkpoint unchanged.
    import deepspeed.module_inject.auto_ep_presets.base as presets
    presets._install_instance_transformers_output_recorders = lambda *a, **k: False
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    ep_size, world = AUTOEP_RUNS[name]
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    model = build_qwen3_moe()
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": 3}, "steps_per_print": 10 ** 9,
           "expert_parallel": {"enabled": True, "autoep_size": ep_size,
                               "preset_model": "qwen3_moe", "use_grouped_mm": False}}
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.98), eps=1e-8,
                            weight_decay=0.01)
    eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    rank = dist.get_rank()
    for step in range(2):
        g = torch.Generator().manual_seed(100 + 10 * step + rank)
        x = torch.randint(0, 16, (1, 8), generator=g)
        loss = eng(input_ids=x, labels=x).loss
        eng.backward(loss)
        eng.step()
    eng.save_checkpoint(out, tag=TAG)

    # each expert tensor's rows: this rank's experts (global ids), from its layer
    first_expert = {}
    for mname, module in model.named_modules():
        if isinstance(module, AutoEPMoELayer):
            for w in ("w1", "w2", "w3"):
                first_expert[f"{mname}.experts.{w}"] = module.ep_rank * module.num_local_experts
    mine = {}
    for pname, p in model.named_parameters():
        values = {"master": safe_get_full_fp32_param(p).float().clone()}
        for key in ("exp_avg", "exp_avg_sq"):
            values[key] = safe_get_full_optimizer_state(p, key).float().clone()
        mine[pname] = (first_expert.get(pname), {k: v.numpy() for k, v in values.items()})
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        from safetensors.torch import save_file
        merged = {}
        for got in everyone:
            for pname, (start, values) in got.items():
                for key, v in values.items():
                    t = torch.from_numpy(v)
                    if start is None:  # a dense parameter: every rank holds it whole
                        if f"{key}/{pname}" in merged and not torch.equal(merged[f"{key}/{pname}"], t):
                            raise SystemExit(f"{key}/{pname}: ranks disagree on DeepSpeed's own value")
                        merged[f"{key}/{pname}"] = t
                    else:
                        merged.setdefault(f"{key}/{pname}", {})[start] = t
        for k, v in list(merged.items()):
            if isinstance(v, dict):  # experts of every expert-parallel rank, in id order
                merged[k] = torch.cat([v[s] for s in sorted(v)])
        save_file({k: v.contiguous() for k, v in sorted(merged.items())},
                  os.path.join(out, "expected.safetensors"), metadata={"format": "pt"})
        facts = {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                 "zero_stage": 3, "ep_size": ep_size, "world_size": world, "bf16": False,
                 "num_experts": NUM_EXPERTS, "config": cfg, "autoep": True}
        with open(os.path.join(out, "run.json"), "w") as f:
            json.dump(facts, f, indent=1, default=str)
    dist.barrier()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make(name: str, root: str = FIXTURES) -> None:
    out = os.path.join(root, name)
    shutil.rmtree(out, ignore_errors=True)
    world = RUNS[name][2] if name in RUNS else AUTOEP_RUNS[name][1]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
                    f"--master_port={free_port()}", os.path.abspath(__file__), "--rank", name, out],
                   env=env, check=True)
    for junk in ("zero_to_fp32.py", "zero_to_torch.py"):
        for where in (out, os.path.join(out, TAG)):
            if os.path.exists(os.path.join(where, junk)):
                os.remove(os.path.join(where, junk))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        (rank_main if sys.argv[2] in RUNS else autoep_rank_main)(sys.argv[2], sys.argv[3])
    else:
        args, root = sys.argv[1:], FIXTURES
        if args[:1] == ["--out"]:
            root, args = os.path.abspath(args[1]), args[2:]
        unknown = [r for r in args if r not in RUNS and r not in AUTOEP_RUNS]
        if unknown:
            sys.exit(f"make_deepspeed_moe_fixtures.py: unknown run(s) {unknown}; runs: "
                     f"{', '.join(list(RUNS) + list(AUTOEP_RUNS))}")
        for run in args or list(RUNS) + list(AUTOEP_RUNS):
            make(run, root)
