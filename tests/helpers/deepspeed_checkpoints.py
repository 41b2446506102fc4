"""DeepSpeed checkpoints for tests: the real fixtures (tests/fixtures/deepspeed/), synthetic ZeRO
checkpoints laid out the way DeepSpeed lays them out, and where an optimizer file keeps its Adam
moments."""

import os
import shutil

import torch

from helpers.paths import DEEPSPEED_FIXTURES as FIXTURES

ALL = sorted(d for d in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, d)))
Z2 = os.path.join(FIXTURES, "zero2_w3_fp32")
Z3 = os.path.join(FIXTURES, "zero3_w3_fp32")


def copy_fixture(src: str, tmp_path) -> str:
    """A writable copy of fixture folder ``src`` under ``tmp_path`` (folders 0755, files 0644)."""
    dst = os.path.join(tmp_path, os.path.basename(src))
    shutil.copytree(src, dst)
    for dirpath, _, files in os.walk(dst):
        os.chmod(dirpath, 0o755)
        for f in files:
            os.chmod(os.path.join(dirpath, f), 0o644)
    return dst


def moment_spans(pt):
    """Byte spans of every exp_avg / exp_avg_sq storage in an optimizer file."""
    osd = pt.obj["optimizer_state_dict"]
    inner = osd.get("optimizer_state_dict") or osd.get("base_optimizer_state")
    spans = []
    for state in inner["state"].values():
        for key in ("exp_avg", "exp_avg_sq"):
            span = pt.archive.record_span(state[key].storage.key)
            spans.append((span.offset, span.offset + span.nbytes))
    return spans


def write_synthetic(root, stage, world_size, params, groups=None, sub_group_numel=None, buffers=None,
                    param_align=1):
    """A ZeRO checkpoint laid out the way DeepSpeed lays it out (written independently of the
    reader's arithmetic): ``params`` {name: fp32 tensor}, ``groups`` lists of names (ZeRO-1/2
    param groups), ``sub_group_numel`` (ZeRO-3 per-rank sub-group size)."""
    from collections import OrderedDict
    tag = os.path.join(root, "global_step1")
    os.makedirs(tag)
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("global_step1")
    buffers = buffers or {}
    groups = groups or [list(params)]
    moments = lambda t: {"exp_avg": torch.full_like(t, 7.0), "exp_avg_sq": torch.full_like(t, 9.0)}
    model = {"module": OrderedDict(buffers), "buffer_names": list(buffers), "shared_params": {},
             "frozen_param_shapes": None, "frozen_param_fragments": None, "ds_version": "synthetic"}
    if stage <= 2:
        per_rank = [[] for _ in range(world_size)]
        paddings = []
        for names in groups:
            pieces, pads, offset = [], [], 0
            for i, n in enumerate(names):  # parameter_alignment: pad after each but the last
                offset += params[n].numel()
                pad = 0 if i == len(names) - 1 else -offset % param_align
                pieces += [params[n].reshape(-1), torch.full((pad,), float("nan"))]
                pads.append(pad)
                offset += pad
            paddings.append(pads)
            flat = torch.cat(pieces)
            align = 2 * world_size
            padded = -(-flat.numel() // align) * align
            part = padded // world_size
            for r in range(world_size):
                per_rank[r].append(flat[r * part:(r + 1) * part].clone())  # padding not saved
        model["param_shapes"] = [OrderedDict((n, params[n].shape) for n in names) for names in groups]
        torch.save(model, os.path.join(tag, "mp_rank_00_model_states.pt"))
        for r in range(world_size):
            osd = {"zero_stage": stage, "partition_count": [world_size] * len(groups),
                   "single_partition_of_fp32_groups": per_rank[r], "param_alignment_paddings": paddings,
                   "base_optimizer_state": {"state": {g: moments(t) for g, t in enumerate(per_rank[r])}}}
            torch.save({"optimizer_state_dict": osd}, os.path.join(tag, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
        return
    chunks = {r: [] for r in range(world_size)}
    subgroups, current, size = [], [], 0
    for name, t in params.items():
        per = -(-t.numel() // world_size)
        padded = torch.cat([t.reshape(-1), torch.full((per * world_size - t.numel(),), float("nan"))])
        for r in range(world_size):
            chunks[r].append((name, padded[r * per:(r + 1) * per]))
        current.append(name)
        size += per
        if size >= sub_group_numel:
            subgroups.append(current)
            current, size = [], 0
    if current:
        subgroups.append(current)
    model["param_shapes"] = [OrderedDict((n, params[n].shape) for n in g) for g in subgroups]
    for r in range(world_size):
        by_name = dict(chunks[r])
        flats = [torch.cat([by_name[n] for n in g]) for g in subgroups]
        torch.save(model, os.path.join(tag, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"))
        osd = {"zero_stage": 3, "partition_count": world_size, "fp32_flat_groups": flats,
               "optimizer_state_dict": {"state": {g: moments(t) for g, t in enumerate(flats)}}}
        torch.save({"optimizer_state_dict": osd}, os.path.join(tag, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
