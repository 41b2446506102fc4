#!/usr/bin/env python3
"""Write a DeepSpeed-format ZeRO-3 checkpoint of any size without training, in flat memory.

The files have the structure DeepSpeed 0.19.8 writes at ZeRO stage 3 with a client
``torch.optim.AdamW`` (compared key by key against real checkpoints in
tests/fixtures/deepspeed by tests/tools/test_make_deepspeed_checkpoint.py):

    <out>/latest                                         the tag, no newline
    <out>/<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt          one per rank
    <out>/<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt   one per rank

Every parameter is split on its own: ``P = ceil(numel / world)`` elements per rank, the
padding (zeros) at the tail, so trailing ranks may hold only padding. A rank's sub-group
holds its chunks of consecutive parameters with no gap; a sub-group closes once its
per-rank element count reaches ``--sub-group-size`` or its parameter group ends (the rule
the real fixtures show). Each sub-group carries fp32 masters and AdamW moments.

Values are deterministic from ``--seed`` and independent of the world size: element i of
parameter p comes from a generator seeded by (seed, p, i // 2**20), so the same seed gives
the same consolidated model at every world size.

Streaming: the optimizer files are written as PyTorch zip archives record by record (the
pickle first, then each storage in chunks of ``CHUNK_ELEMENTS``), data 64-byte aligned as
torch.save aligns it, so memory stays flat in the checkpoint size; the small model-state
files go through torch.save. DeepSpeed also copies its ``zero_to_fp32.py`` beside ``latest``;
this tool never ships DeepSpeed code: ``--zero-to-fp32 PATH`` copies a script you have.

    python tools/make_deepspeed_checkpoint.py --out /work/bench/ds2700m --params 2.7e9 --world 2
    python tools/make_deepspeed_checkpoint.py --out /tmp/moe --params 27e6 --tensors 100000

A JSON summary goes to stdout. ``--smoke`` writes a tiny one (for the test suite).
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import math
import os
import pickle
import shutil
import struct
import sys
import time
import zipfile

import torch

CHUNK_ELEMENTS = 1 << 20          # generator chunk and write unit (elements)
SEED_STRIDE = 1_000_003           # mixes (seed, parameter, chunk, kind) into one seed
DS_VERSION = "0.19.8"
SMOKE = dict(params=200_000, hidden=64, layers=2, vocab=256)


# ---------------------------------------------------------------- the model's shapes
def decoder_shapes(vocab: int, hidden: int, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """A Llama-like decoder's trainable parameters, in module order (untied head)."""
    inter = 64 * max(1, round(hidden * 8 / 3 / 64))
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        pre = f"model.layers.{i}."
        shapes.append((pre + "input_layernorm.weight", (hidden,)))
        shapes += [(pre + f"self_attn.{n}_proj.weight", (hidden, hidden)) for n in "qkvo"]
        shapes.append((pre + "post_attention_layernorm.weight", (hidden,)))
        shapes += [(pre + "mlp.gate_proj.weight", (inter, hidden)),
                   (pre + "mlp.up_proj.weight", (inter, hidden)),
                   (pre + "mlp.down_proj.weight", (hidden, inter))]
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return shapes


def total(shapes) -> int:
    return sum(math.prod(s) for _, s in shapes)


def decoder_for(params: int, vocab: int) -> tuple[int, int]:
    """(hidden, layers) whose decoder holds about ``params`` elements: hidden a multiple of
    64 near 128 x layers (the usual aspect), layers then fitted to the count."""
    hidden = 64
    while hidden < 1 << 16:
        layers = max(1, hidden // 128)
        if total(decoder_shapes(vocab, hidden + 64, layers)) > params:
            break
        hidden += 64
    per_layer = total(decoder_shapes(vocab, hidden, 1)) - total(decoder_shapes(vocab, hidden, 0))
    layers = max(1, round((params - total(decoder_shapes(vocab, hidden, 0))) / per_layer))
    return hidden, layers


def many_tensor_shapes(count: int, params: int, hidden: int) -> list:
    """``count`` small expert-like matrices (rows x hidden) holding about ``params`` elements
    together, named like a mixture-of-experts decoder's per-expert weights."""
    rows = max(1, params // count // hidden)
    experts = 1000
    return [(f"model.layers.{i // experts}.mlp.experts.{i % experts}.weight", (rows, hidden))
            for i in range(count)]


def sub_groups(shapes, world: int, sub_group_size: int) -> list[list[int]]:
    """Parameter indices per sub-group: closes once its per-rank elements reach the size, or
    at the end of the (single) parameter group."""
    groups, current, size = [], [], 0
    for i, (_, shape) in enumerate(shapes):
        current.append(i)
        size += math.ceil(math.prod(shape) / world)
        if size >= sub_group_size or i == len(shapes) - 1:
            groups.append(current)
            current, size = [], 0
    return groups


# ---------------------------------------------------------------- deterministic values
KINDS = {"master": (0, 0.02), "exp_avg": (1, 1e-3), "exp_avg_sq": (2, 1e-6)}


def values(seed: int, param: int, numel: int, kind: str, start: int, stop: int):
    """Yield fp32 tensors covering elements [start, stop) of parameter ``param``'s ``kind``
    (master, exp_avg, exp_avg_sq; ``numel`` elements in all), chunk by chunk. A chunk is
    always drawn whole: torch's randn of a shorter length is not a prefix of a longer one."""
    code, scale = KINDS[kind]
    gen = torch.Generator()
    pos = start
    while pos < stop:
        chunk = pos // CHUNK_ELEMENTS
        gen.manual_seed(((seed * SEED_STRIDE + param) * SEED_STRIDE + chunk) * 3 + code)
        base = chunk * CHUNK_ELEMENTS
        length = min(numel, base + CHUNK_ELEMENTS) - base
        end = min(stop, base + length)
        draw = torch.rand if kind == "exp_avg_sq" else torch.randn
        yield draw(length, generator=gen)[pos - base:end - base].mul_(scale)
        pos = end


def rank_chunks(seed: int, shapes, group: list[int], world: int, rank: int, kind: str):
    """Yield this rank's flat sub-group for ``kind``: each parameter's ceil(n/world) slice,
    zeros where the slice runs past the parameter (ZeRO-3's tail padding)."""
    for p in group:
        numel = math.prod(shapes[p][1])
        part = math.ceil(numel / world)
        start = min(numel, rank * part)
        stop = min(numel, start + part)
        yield from values(seed, p, numel, kind, start, stop)
        pad = part - (stop - start)
        while pad > 0:
            n = min(pad, CHUNK_ELEMENTS)
            yield torch.zeros(n)
            pad -= n


# ---------------------------------------------------------------- pickling as DeepSpeed does
def standin_class(module: str, name: str, **attrs) -> type:
    """A class that pickles as DeepSpeed's ``module.name`` without importing deepspeed."""
    return type(name, (), {"__module__": module, "__qualname__": name, "_standin": True,
                           **attrs})


ZeroStageEnum = standin_class("deepspeed.runtime.zero.config", "ZeroStageEnum",
                              __init__=lambda self, v: setattr(self, "value", v),
                              __reduce__=lambda self: (type(self), (self.value,)))
LossScaler = standin_class("deepspeed.runtime.fp16.loss_scaler", "LossScaler")


class Storage:
    """One storage record: dtype, elements and a function yielding its tensors in order."""

    def __init__(self, dtype: torch.dtype, numel: int, chunks):
        self.dtype, self.numel, self.chunks = dtype, numel, chunks


class LazyTensor:
    """A 1-D (or scalar) tensor written later from ``storage``; pickles as torch's tensors."""

    def __init__(self, storage: Storage, shape: tuple):
        self.storage, self.shape = storage, shape

    def __reduce__(self):
        stride = (1,) if self.shape else ()
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, self.shape, stride, False, collections.OrderedDict()))


STORAGE_TYPES = {torch.float32: "FloatStorage", torch.bfloat16: "BFloat16Storage"}


class ArchivePickler(pickle._Pickler):
    """Pickles storages as torch.save's persistent ids and DeepSpeed stand-ins by name."""

    def __init__(self, file):
        super().__init__(file, protocol=2)
        self.storages: list[Storage] = []

    def persistent_id(self, obj):
        if not isinstance(obj, Storage):
            return None
        self.storages.append(obj)
        return ("storage", getattr(torch, STORAGE_TYPES[obj.dtype]),
                str(len(self.storages) - 1), "cpu", obj.numel)

    def save_global(self, obj, name=None):
        if getattr(obj, "_standin", False):
            self.write(pickle.GLOBAL + f"{obj.__module__}\n{obj.__qualname__}\n".encode())
            self.memoize(obj)
            return
        super().save_global(obj, name)

    dispatch = dict(pickle._Pickler.dispatch)
    dispatch[type] = save_global


def write_archive(path: str, obj, serial: int) -> int:
    """Write ``obj`` as a torch.save zip archive, streaming each Storage; returns bytes."""
    buf = io.BytesIO()
    pickler = ArchivePickler(buf)
    pickler.dump(obj)
    root = os.path.splitext(os.path.basename(path))[0]
    records = [("data.pkl", [buf.getvalue()]), (".format_version", [b"1"]),
               (".storage_alignment", [b"64"]), ("byteorder", [b"little"])]
    records += [(f"data/{i}", (t.numpy().view("uint8") for t in s.chunks()))
                for i, s in enumerate(pickler.storages)]
    records += [("version", [b"3\n"]), (".data/serialization_id", [str(serial).zfill(40).encode()])]
    with open(path + ".tmp", "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as zf:
        for name, parts in records:
            info = zipfile.ZipInfo(f"{root}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
            # torch mmaps storages: data starts at a multiple of 64 bytes (header 30 bytes +
            # name + this padding field + the 20-byte zip64 field)
            head = 30 + len(info.filename.encode()) + 20 + 4
            pad = (-(f.tell() + head)) % 64
            info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad
            with zf.open(info, "w", force_zip64=True) as out:
                for part in parts:
                    out.write(part)
    os.replace(path + ".tmp", path)
    return os.path.getsize(path)


# ---------------------------------------------------------------- the checkpoint's files
def ds_config(bf16: bool, sub_group_size: int) -> dict:
    config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "sub_group_size": sub_group_size}}
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def optim_state(args, shapes, groups, rank: int) -> dict:
    """The optimizer-states file's object for one rank (flat groups stream from Storages)."""
    def flat(group, kind):
        numel = sum(math.ceil(math.prod(shapes[p][1]) / args.world) for p in group)
        storage = Storage(torch.float32, numel,
                          lambda: rank_chunks(args.seed, shapes, group, args.world, rank, kind))
        return LazyTensor(storage, (numel,))

    def step():
        return LazyTensor(Storage(torch.float32, 1, lambda: [torch.tensor([float(args.steps)])]), ())

    state = {i: {"step": step(), "exp_avg": flat(g, "exp_avg"), "exp_avg_sq": flat(g, "exp_avg_sq")}
             for i, g in enumerate(groups)}
    param_group = {"weight_decay": 0.01, "lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-08,
                   "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                   "differentiable": False, "fused": None, "decoupled_weight_decay": True,
                   "params": list(range(len(groups)))}
    scaler = LossScaler()
    scaler.__dict__.update(cur_scale=1.0, dynamic=False)
    inner = {"zero_stage": ZeroStageEnum(3), "loss_scaler": scaler, "dynamic_loss_scale": False,
             "overflow": False, "partition_count": args.world,
             "optimizer_state_dict": {"state": state, "param_groups": [param_group]},
             "fp32_flat_groups": [flat(g, "master") for g in groups]}
    config = ds_config(args.bf16, args.sub_group_size)
    return {"optimizer_state_dict": inner, "ds_config": config, "ds_version": DS_VERSION}


def model_state(args, shapes, groups) -> dict:
    """The model-states file's object (the same on every rank: no frozen params, no buffers)."""
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return {"module": collections.OrderedDict((n, torch.empty(0, dtype=dtype)) for n, _ in shapes),
            "buffer_names": [], "optimizer": None,
            "param_shapes": [collections.OrderedDict((shapes[p][0], torch.Size(shapes[p][1]))
                                                     for p in g) for g in groups],
            "frozen_param_shapes": collections.OrderedDict(), "shared_params": {},
            "frozen_param_fragments": collections.OrderedDict(),
            "lr_scheduler": None, "data_sampler": None, "random_ltd": None, "skipped_steps": 0,
            "global_steps": args.steps, "global_samples": args.steps * args.world,
            "dp_world_size": args.world, "mp_world_size": 1,
            "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
            "ds_config": ds_config(args.bf16, args.sub_group_size), "ds_version": DS_VERSION}


def write_checkpoint(args, shapes) -> dict:
    """Write every file; returns the JSON summary."""
    started = time.monotonic()
    tag = args.tag or f"global_step{args.steps}"
    tag_dir = os.path.join(args.out, tag)
    os.makedirs(tag_dir, exist_ok=True)
    groups = sub_groups(shapes, args.world, args.sub_group_size)
    prefix = "bf16_" if args.bf16 else ""
    written, files = 0, []
    for rank in range(args.world):
        model_path = os.path.join(tag_dir, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        torch.save(model_state(args, shapes, groups), model_path)
        optim_path = os.path.join(tag_dir, f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        written += os.path.getsize(model_path)
        written += write_archive(optim_path, optim_state(args, shapes, groups, rank),
                                 serial=args.seed * 1000 + rank)
        files += [model_path, optim_path]
    with open(os.path.join(args.out, "latest"), "w") as f:
        f.write(tag)
    if args.zero_to_fp32:
        shutil.copyfile(args.zero_to_fp32, os.path.join(args.out, "zero_to_fp32.py"))
    return {"out": args.out, "tag": tag, "world_size": args.world,
            "model_dtype": "bf16" if args.bf16 else "fp32", "params": total(shapes),
            "tensors": len(shapes), "sub_groups": len(groups), "bytes_written": written,
            "files": [os.path.relpath(p, args.out) for p in files],
            "seconds": round(time.monotonic() - started, 3)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="checkpoint folder to write (created)")
    p.add_argument("--world", type=int, default=2, help="data-parallel ranks (default 2)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="model dtype: bf16 names the optimizer files bf16_* (masters stay fp32)")
    p.add_argument("--params", type=float, default=None,
                   help="about this many parameters (elements); picks --hidden/--layers")
    p.add_argument("--layers", type=int, default=None, help="decoder blocks")
    p.add_argument("--hidden", type=int, default=None, help="model width (elements)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tensors", type=int, default=None,
                   help="instead of a decoder: this many small (rows x --hidden) tensors holding "
                        "--params elements together, like per-expert weights")
    p.add_argument("--sub-group-size", type=int, default=1_000_000_000,
                   help="per-rank elements per sub-group (DeepSpeed's default 1e9)")
    p.add_argument("--steps", type=int, default=2, help="recorded global steps (tag global_step<N>)")
    p.add_argument("--tag", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--zero-to-fp32", default=None,
                   help="copy this zero_to_fp32.py (from your DeepSpeed install) beside latest")
    p.add_argument("--smoke", action="store_true", help="a tiny checkpoint, for the test suite")
    args = p.parse_args(argv)
    if args.smoke:
        args.vocab, args.hidden, args.layers = SMOKE["vocab"], SMOKE["hidden"], SMOKE["layers"]
    if args.world < 1:
        p.error(f"--world must be at least 1, got {args.world}")
    args.bf16 = args.dtype == "bf16"
    return args


def shapes_for(args) -> list:
    if args.tensors:
        params = int(args.params or args.tensors * 256)
        return many_tensor_shapes(args.tensors, params, args.hidden or 16)
    if args.hidden is None or args.layers is None:
        hidden, layers = decoder_for(int(args.params or 270e6), args.vocab)
        args.hidden, args.layers = args.hidden or hidden, args.layers or layers
    return decoder_shapes(args.vocab, args.hidden, args.layers)


def main(argv=None) -> int:
    args = parse_args(argv)
    summary = write_checkpoint(args, shapes_for(args))
    json.dump(summary, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
