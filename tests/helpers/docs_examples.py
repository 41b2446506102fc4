"""The example inputs docs/cli.md's commands read, made in one call (no tests here).

``make_cli_examples(root)`` writes, under ``root``:

- ``ckpt``: an offload-engine checkpoint of a small model (4 ranks, step 7;
  ``helpers.inspect_fixtures.make_checkpoint``);
- ``store``: the same states in a live store written through a real ``TieredStore`` (step 11);
- ``bad``: the checkpoint with one NaN in a Muon momentum buffer
  (``layers.1.attn.wq.weight[30, 7]``) and one Inf in an Adam second moment
  (``layers.0.norm.weight[3]``);
- ``corrupt``: the checkpoint with one bit flipped in ``rank1/master/c/0`` (the manifest's
  crc32c no longer matches);
- ``model.safetensors``: the checkpoint's weights (fp32 masters where there are, else params),
  what consolidating it writes.

docs/cli.md's setup line calls it, so every path its examples use exists.
"""

from __future__ import annotations

import os
import shutil

from safetensors.torch import save_file

from helpers.inspect_fixtures import make_checkpoint, make_live_store, model_tensors

CORRUPT_CHUNK = os.path.join("step-00000007", "rank1", "master", "c", "0")
CORRUPT_BYTE, CORRUPT_BIT = 100, 0


def weights(tensors: dict) -> dict:
    """What consolidate writes for ``tensors``: the fp32 master where there is one, else the
    parameter, by name."""
    return {name: (t["states"]["master"] if "master" in t["states"] else t["states"]["param"])
            .clone().contiguous() for name, t in tensors.items()}


def make_cli_examples(root: str) -> str:
    """Write the inputs listed in the module docstring under ``root`` (created; existing
    example folders are replaced) and return ``root``."""
    os.makedirs(root, exist_ok=True)
    for name in ("ckpt", "store", "bad", "corrupt"):
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    _, tensors = make_checkpoint(os.path.join(root, "ckpt"))
    make_live_store(os.path.join(root, "store"))
    save_file(weights(tensors), os.path.join(root, "model.safetensors"),
              metadata={"format": "pt"})
    bad = model_tensors()
    bad["layers.1.attn.wq.weight"]["states"]["momentum_buffer"][30, 7] = float("nan")
    bad["layers.0.norm.weight"]["states"]["exp_avg_sq"][3] = float("inf")
    make_checkpoint(os.path.join(root, "bad"), bad)
    make_checkpoint(os.path.join(root, "corrupt"))
    chunk = os.path.join(root, "corrupt", CORRUPT_CHUNK)
    with open(chunk, "r+b") as f:
        f.seek(CORRUPT_BYTE)
        byte = f.read(1)[0]
        f.seek(CORRUPT_BYTE)
        f.write(bytes([byte ^ (1 << CORRUPT_BIT)]))
    return root
