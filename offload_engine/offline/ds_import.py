"""Import a DeepSpeed ZeRO-1/2/3 run as one of our checkpoints, to resume it with ZeroMuon.

    summary = from_deepspeed("ds_ckpt/", "ckpt/", world_size=8)
    # then, on each of the 8 ranks:
    opt = ZeroMuon(model.named_parameters(), use_muon_rule=use_muon_rule("ckpt/"), ...)
    step = load_checkpoint("ckpt/", model, opt)
    sched.load_state_dict(imported_state("ckpt/")["lr_scheduler"])

The DeepSpeed files are read through ``formats.deepspeed`` (restricted unpickler: no code
from the pickle runs), window by window; the generation is written by the checkpoint
layer's own writer and commit (``import_writer.py``), resharded to ``world_size`` ranks
as FSDP2 ``Shard(0)`` rows. What is imported: the fp32 masters (``param`` in the model's
dtype, and ``master_param`` where that is not fp32), Adam's moments and step count, the
momentum of DeepSpeed's Muon (ZeRO-1/2/3), the model's buffers, and, in the generation's
attributes under ``imported``, the engine's global step and samples, the LR scheduler's
state and DeepSpeed's param groups. See docs/migrate.md, "Importing a DeepSpeed
checkpoint".
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field

from ..dtypes import DType, dtype as as_dtype
from ..formats.deepspeed import DeepSpeedSource
from ..formats.deepspeed.files import resolve_tag_dir
from ..formats.errors import FormatError
from ..jsonlimits import read_json_file
from .import_plan import Disagreement, TensorPlan, plan_tensors
from ..layout.group_stream import Streamed
from .import_writer import WINDOW_BYTES, write_generation
from ..errors import InputError

IMPORTED = "imported"        # the generation attribute holding what the import carried over
OFFLOADED = "offloaded_tensors"  # where DeepSpeed copies its NVMe swap files at save time
MAX_MODEL_CONFIG_BYTES = 16 << 20  # a Hugging Face config.json is a few KB; read whole


@dataclass
class ImportSummary:
    """What ``from_deepspeed`` did. ``generation`` is the committed folder; ``step`` the
    step ``load_checkpoint`` returns (DeepSpeed's global step)."""

    source: str
    generation: str
    world_size: int
    step: int
    zero_stage: int
    source_world_size: int
    param_dtype: str
    muon: list[str] = field(default_factory=list)
    adamw: list[str] = field(default_factory=list)
    other: list[str] = field(default_factory=list)
    disagreements: list[Disagreement] = field(default_factory=list)
    tied: dict[str, str] = field(default_factory=dict)   # {alias: owner}, as recorded
    notes: list[str] = field(default_factory=list)
    run_state: dict = field(default_factory=dict)
    bytes_written: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["disagreements"] = [asdict(d) for d in self.disagreements]
        return out


def model_dtype(model_config: str | None) -> DType | None:
    """The parameter dtype a Hugging Face ``config.json`` names (``torch_dtype`` or
    ``dtype``); None without a file or without the key."""
    if model_config is None:
        return None
    cfg = read_json_file(model_config, MAX_MODEL_CONFIG_BYTES, what="model config",
                         error=FormatError)  # strict and bounded: docs/untrusted-input.md
    name = cfg.get("torch_dtype", cfg.get("dtype")) if isinstance(cfg, dict) else None
    if name is None:
        return None
    try:
        dt = as_dtype(str(name).removeprefix("torch."))
    except (KeyError, ValueError, TypeError):
        dt = None
    if dt is None or dt.kind != "float":
        raise FormatError(f"{model_config}: torch_dtype {name!r} is not a floating point dtype")
    return dt


def _plain(value):
    """``value`` if it is JSON data (dicts with string keys, lists, numbers, strings), else
    None."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return None
    return value


def _param_groups(groups) -> list[dict]:
    out = []
    for g in groups or []:
        if isinstance(g, dict):
            out.append({k: v for k, v in g.items() if k != "params" and _plain(v) is not None})
    return out


def from_deepspeed(ckpt: str, out: str, world_size: int, tag: str | None = None,
                   model_config: str | None = None, window_bytes: int = WINDOW_BYTES,
                   progress=None) -> ImportSummary:
    """Write DeepSpeed checkpoint ``ckpt`` (its ``latest`` tag, or ``tag``) as a checkpoint
    generation under ``out`` for ZeroMuon at ``world_size`` ranks, and commit it.

    Args:
        model_config: a Hugging Face ``config.json``; its ``torch_dtype`` is the dtype of
            the model's parameters (default: bf16 for a DeepSpeed bf16 run, else fp32).
        window_bytes: bytes read from the DeepSpeed files at a time (memory bound).
        progress: ``progress(rank, bytes written so far)`` after each target rank.

    Raises FormatError naming the file for a corrupt, incomplete or unsupported checkpoint
    (NVMe-offloaded optimizer state, ZeRO-1/2 Muon momentum of sizes that are not the
    whole parameters overlapping each rank's partition, Muon on a non-matrix).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"world_size must be a positive integer, not {world_size!r}")
    t0 = time.perf_counter()
    _, tag_dir = resolve_tag_dir(ckpt, tag)
    offloaded = os.path.join(tag_dir, OFFLOADED)
    if os.path.isdir(offloaded):
        raise FormatError(f"{offloaded}: this run kept its optimizer state on NVMe "
                          f"(offload_optimizer device nvme) and DeepSpeed saved it as swap files, "
                          f"which are not read; resume it in DeepSpeed without NVMe offload and save again")
    param_dtype = model_dtype(model_config)
    with DeepSpeedSource(ckpt, tag) as src:
        if src.stage12_momentum is not None:  # a layout not mapped: never imported as momentum
            raise FormatError(src.stage12_momentum)
        if param_dtype is None and src.bf16:
            param_dtype = as_dtype("bfloat16")
        plans, disagreements, notes = plan_tensors(src.tensors(), src.optimizer, param_dtype,
                                                   src.tag_dir)
        run_state = {k: _plain(v) for k, v in src.run_state.items()}
        if src.run_state.get("lr_scheduler") is not None and run_state["lr_scheduler"] is None:
            notes.append("the LR scheduler's state holds values that are not plain data; "
                         "it is not carried over")
        step = src.global_steps if type(src.global_steps) is int else 0
        imported = {"from": "deepspeed", "path": os.path.abspath(src.tag_dir), "tag": src.tag,
                    "deepspeed_version": _plain(src.ds_version), "zero_stage": src.stage,
                    "world_size": src.world_size, **run_state,
                    "param_groups": _param_groups(src.param_groups),
                    # written one by one (a mixture-of-experts AdamW run disagrees on
                    # every expert matrix: 100,000 entries)
                    "disagreements": Streamed.array(map(_record, disagreements))}
        if src.experts:  # DeepSpeed MoE: experts keep DeepSpeed's names (docs/migrate.md)
            imported["experts"] = dict(src.experts)
            notes.append(f"mixture-of-experts: {len(src.experts)} MoE layer(s), "
                         f"{sum(src.experts.values())} experts, imported under DeepSpeed's names "
                         f"(native MoE: one tensor per expert, global ids; AutoEP: grouped)")

        tied = _tied(src.aliases(), plans)
        attrs = {IMPORTED: imported, **({"aliases": tied} if tied else {})}
        written = write_generation(out, step, world_size, plans, src.read, attrs,
                                   window_bytes=window_bytes, progress=progress)
        trainable = [p for p in plans if p.kind == "param"]
        return ImportSummary(
            source=src.describe(), generation=written.path, world_size=world_size, step=step,
            zero_stage=src.stage, source_world_size=src.world_size,
            param_dtype=(param_dtype.name if param_dtype else "float32"),
            muon=[p.name for p in trainable if p.optimizer == "muon"],
            adamw=[p.name for p in trainable if p.optimizer == "adamw"],
            other=[p.name for p in plans if p.kind != "param"],
            disagreements=disagreements, tied=tied, notes=notes, run_state=run_state,
            bytes_written=written.bytes_written, seconds=time.perf_counter() - t0)


def _record(d: Disagreement) -> dict:
    """A disagreement as the manifest records it (``asdict``'s keys, without its copying)."""
    return {"name": d.name, "deepspeed": d.deepspeed, "default": d.default}


def _tied(aliases: dict[str, str], plans: list[TensorPlan]) -> dict[str, str]:
    """DeepSpeed's tied names (``shared_params``: the output head sharing the embedding)
    as the checkpoint's ``aliases``, which ``save_checkpoint`` records for a tied model:
    consolidate then writes the name (recorded as tied, as from the DeepSpeed checkpoint
    itself) and ``load_checkpoint`` finds the parameter under either name."""
    written = {p.name for p in plans}
    return {a: o for a, o in aliases.items() if o in written and a not in written}


def disagreement_summary(disagreements: list[Disagreement], most: int = 3) -> list[str]:
    """One line per kind of disagreement (DeepSpeed's optimizer, ZeroMuon's default) with
    its count and the first ``most`` names: a plain AdamW run of 8 layers disagrees on its
    48 matrices, which one line per matrix buried. Every name is in ``--verbose`` and
    ``--json`` (``ImportSummary.disagreements``)."""
    kinds: dict[tuple[str, str], list[str]] = {}
    for d in disagreements:
        kinds.setdefault((d.deepspeed, d.default), []).append(d.name)
    lines = []
    for (deepspeed, default), names in kinds.items():
        shown = ", ".join(names[:most]) + (f" and {len(names) - most} more"
                                           if len(names) > most else "")
        count = f"{len(names)} parameter{'s' if len(names) != 1 else ''}"
        lines.append(f"{count} used {deepspeed} in the DeepSpeed run where ZeroMuon's "
                     f"default rule picks {default}; imported as {deepspeed} ({shown})")
    return lines


def imported_state(ckpt_dir: str, tag: str | None = None) -> dict:
    """What an imported generation carried over besides tensors: ``global_steps``,
    ``global_samples``, ``skipped_steps``, ``lr_scheduler`` (DeepSpeed's scheduler
    ``state_dict``, or None), DeepSpeed's ``param_groups`` and the ``disagreements``.
    FormatError for a generation that was not imported."""
    from ..formats.ours import OursSource

    with OursSource.open_checkpoint(ckpt_dir, tag) as src:
        got = src.manifest.extra.get(IMPORTED)
        if not isinstance(got, dict):
            raise FormatError(f"{src.group}: not an imported checkpoint (no '{IMPORTED}' attribute)")
        return got


def use_muon_rule(ckpt_dir: str, tag: str | None = None):
    """``rule(name, param) -> bool`` for ZeroMuon's ``use_muon_rule``: the optimizer the
    checkpoint's tensor table records for each parameter, ZeroMuon's default rule for
    parameters it does not list."""
    from ..formats.ours import OursSource
    from ..optim.param_rules import default_use_muon

    with OursSource.open_checkpoint(ckpt_dir, tag) as src:
        kinds = {t.name: t.optimizer for t in src.tensors()}

    def rule(name, param) -> bool:
        kind = kinds.get(name)
        return kind == "muon" if kind in ("muon", "adamw") else default_use_muon(name, param)
    return rule
