"""Inputs for the inspect / diff / export tests (no tests here).

- ``model_tensors``: a small model's parameters and optimizer states (Muon matrices with a
  bf16 parameter, an fp32 master and a momentum buffer; AdamW vectors with exp_avg and
  exp_avg_sq), full and unsharded.
- ``make_checkpoint``: an offload-engine checkpoint of them (docs/format.md: a generation
  group with the manifest, crc32c checksums, ``committed``; ``latest``), 4 ranks, 4 KiB
  chunks so every array has several chunk files.
- ``make_live_store``: the same states written through a real ``TieredStore``, the tensor
  table added with ``update_manifest`` and the ranks' shard tables beside it, as the
  optimizer does (here one store holds all 4 ranks).
"""

from __future__ import annotations

import os
import shutil

import torch

from helpers.synthetic import plan_sharded, write_checkpoint
from offload_engine.layout.manifest import write_shard_table
from offload_engine.cli.main import main
from offload_engine.store import TieredStore
from helpers.paths import DEEPSPEED_FIXTURES as FIXTURES

DS_ALL = sorted(d for d in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, d)))


def model_tensors(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(2):
        w = torch.randn(48, 40, generator=g)
        out[f"layers.{layer}.attn.wq.weight"] = {
            "shape": [48, 40], "dtype": torch.bfloat16, "optimizer": "muon",
            "states": {"param": w.bfloat16(), "master": w,
                       "momentum_buffer": 0.01 * torch.randn(48, 40, generator=g)}}
        n = torch.randn(40, generator=g)
        out[f"layers.{layer}.norm.weight"] = {
            "shape": [40], "dtype": torch.float32, "optimizer": "adamw",
            "states": {"param": n, "exp_avg": 0.1 * torch.randn(40, generator=g),
                       "exp_avg_sq": torch.rand(40, generator=g) * 1e-4}}
    e = torch.randn(37, 16, generator=g)
    out["emb.weight"] = {"shape": [37, 16], "dtype": torch.bfloat16, "optimizer": "adamw",
                         "states": {"param": e.bfloat16(), "master": e,
                                    "exp_avg": 0.1 * torch.randn(37, 16, generator=g),
                                    "exp_avg_sq": torch.rand(37, 16, generator=g) * 1e-3}}
    out["scalar"] = {"shape": [], "dtype": torch.float32, "optimizer": "adamw",
                     "states": {"param": torch.tensor(3.5), "exp_avg": torch.tensor(0.25),
                                "exp_avg_sq": torch.tensor(0.0625)}}
    return out


def make_checkpoint(root, tensors=None, world_size: int = 4, step: int = 7) -> tuple[str, dict]:
    tensors = tensors if tensors is not None else model_tensors()
    os.makedirs(root, exist_ok=True)
    write_checkpoint(str(root), tensors, world_size, step, chunk_bytes=4096)
    return str(root), tensors


def make_live_store(root, tensors=None, world_size: int = 4, step: int = 11,
                    with_table: bool = True) -> tuple[str, dict]:
    """A store directory written by TieredStore (8 KiB buckets = chunk files)."""
    tensors = tensors if tensors is not None else model_tensors()
    arrays, entries, shards, writes = plan_sharded(tensors, world_size)
    config = {"nvme_paths": [str(root)], "cpu_budget": "64KiB", "bucket_bytes": "8KiB",
              "prefetch_depth": 1}
    with TieredStore(config) as store:
        from offload_engine.dtypes import zarr_dtype
        for name, meta in arrays.items():
            store.register(name, zarr_dtype(meta["dtype"]).torch, meta["numel"])
        for array, offset, values in writes:
            for lo, hi in store.bucket_ranges(array):
                a, b = max(lo, offset), min(hi, offset + values.numel())
                if a >= b:
                    continue
                h = store.acquire(array, (a, b))
                h.tensor.copy_(values[a - offset:b - offset])
                store.release(h, dirty=True)
        if with_table:
            for rank, table in shards.items():
                write_shard_table(store.root, rank, table)
            store.update_manifest({"tensors": entries, "world_size": world_size, "step": step})
    return str(root), tensors


def full_state(tensors: dict, name: str, state: str) -> torch.Tensor:
    return tensors[name]["states"][state]


def run_cli(args, capsys):
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def copy_fixture(name: str, tmp_path) -> str:
    dst = os.path.join(tmp_path, name)
    shutil.copytree(os.path.join(FIXTURES, name), dst)
    for dirpath, _, files in os.walk(dst):
        os.chmod(dirpath, 0o755)
        for f in files:
            os.chmod(os.path.join(dirpath, f), 0o644)
    return dst


def assert_one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)
