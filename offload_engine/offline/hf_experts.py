"""Grouped expert stacks written under the per-expert names Hugging Face checkpoints use.

transformers 5.x holds a Mixture-of-experts block's experts fused
(``mlp.experts.gate_up_proj [E, 2I, H]``, gate rows first, and ``mlp.experts.down_proj
[E, H, I]``) but ``save_pretrained`` writes, and every released checkpoint holds, one 2-D
weight per expert (5.25, checked by tests/integration/test_hf_moe.py). The names, by
family (``model_type`` of config.json; the lists are transformers 5.25's conversion
table):

- ``qwen2_moe`` family (Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3, GLM-4-MoE, ...):
  ``P.experts.gate_up_proj[e]`` rows ``[0, I)`` -> ``P.experts.{e}.gate_proj.weight``,
  rows ``[I, 2I)`` -> ``P.experts.{e}.up_proj.weight``; ``P.experts.down_proj[e]`` ->
  ``P.experts.{e}.down_proj.weight``; every other name as stored;
- ``mixtral`` family (Mixtral, MiniMax): the same cut, named ``w1`` (gate), ``w3`` (up),
  ``w2`` (down), and ``.mlp.`` is ``.block_sparse_moe.`` in every name (the router is
  ``block_sparse_moe.gate.weight``);
- any other stack ``P.experts.N [E, ...]`` (torchtitan's ``moe.experts.w1/w2/w3``) ->
  ``P.experts.{e}.N.weight``, expert ``e``'s slice (``[F, D]``: a Linear weight, out x in).

Every output tensor is a contiguous range of its stack (expert ``e``, then its gate or up
rows), so consolidate streams it window by window like any tensor: memory does not grow
with the number of experts. Bad input is refused before anything is written: a fused
stack with an odd number of rows, stacks of one block that disagree on E or on their
sizes, an expert count that config.json contradicts, an output name that the input holds
already.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

from ..errors import InputError
from ..jsonlimits import read_json_file
from ..formats.source import ReadRequest, TensorMeta, TensorSource
from .experts import expert_count, sliced_meta, state_offset

QWEN2_MOE = "qwen2_moe"
MIXTRAL = "mixtral"
FAMILIES = (QWEN2_MOE, MIXTRAL)
# model_type -> family, as transformers 5.25's conversion table (conversion_mapping.py)
_FAMILY_OF = {
    **{t: MIXTRAL for t in ("mixtral", "minimax", "minimax_m2")},
    **{t: QWEN2_MOE for t in (
        "qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_omni_moe", "qwen3_omni_moe_thinker",
        "qwen3_omni_moe_text", "olmoe", "flex_olmo", "deepseek_v2", "deepseek_v3",
        "deepseek_v32", "dots1", "ernie4_5_moe", "glm4_moe", "glm4_moe_lite", "glm4v_moe",
        "glm_moe_dsa", "hunyuan_v1_moe", "longcat_flash", "solar_open", "mellum", "afmoe",
        "beam", "sarvam_mla", "exaone_moe", "cohere2_moe")},
}
# the fused stacks: name -> [(output module, first row as a fraction of dim 1's halves)]
_PARTS = {
    QWEN2_MOE: {"gate_up_proj": (("gate_proj", 0), ("up_proj", 1)), "down_proj": (("down_proj", None),)},
    MIXTRAL: {"gate_up_proj": (("w1", 0), ("w3", 1)), "down_proj": (("w2", None),)},
}
# config.json keys that give the number of routed experts
_CONFIG_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")
_CONFIG_MAX_BYTES = 4 * 2**20


def family_of(model_type: str | None) -> str | None:
    """The naming family of a config.json ``model_type``, or None when unknown."""
    return _FAMILY_OF.get(model_type) if isinstance(model_type, str) else None


def read_config(path: str) -> dict:
    """A config.json as a dict; InputError naming the file when it is not one (or is over
    4 MiB: a config is a few KiB, and a checkpoint's files may come from anyone)."""
    # strict and bounded (jsonlimits): a FIFO, /dev/zero, NaN or deep nesting is refused
    doc = read_json_file(path, _CONFIG_MAX_BYTES, what="model config")
    if not isinstance(doc, dict):
        raise InputError(f"{path}: not a JSON object")
    return doc


def config_experts(config: dict) -> int | None:
    """The number of routed experts a config.json declares, or None."""
    for key in _CONFIG_EXPERTS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


@dataclass(frozen=True)
class Piece:
    """Output tensor ``name``: ``numel(shape)`` elements of stack ``stack`` from ``start``."""

    name: str
    stack: str
    start: int
    shape: tuple[int, ...]
    expert: int


def _rename(name: str, family: str | None) -> str:
    return name.replace(".mlp.", ".block_sparse_moe.") if family == MIXTRAL else name


def stack_pieces(name: str, shape: Sequence[int], family: str | None) -> list[Piece]:
    """The per-expert tensors of stack ``name`` of ``shape`` ``[E, ...]``, expert by expert
    in storage order (see the module docstring for the names)."""
    experts = int(shape[0])
    prefix, _, leaf = name.rpartition(".")
    prefix = _rename(prefix + ".", family)[:-1]
    parts = _PARTS[family or QWEN2_MOE].get(leaf)
    per = 1
    for d in shape[1:]:
        per *= d
    pieces = []
    for e in range(experts):
        if parts is None:
            pieces.append(Piece(f"{prefix}.{e}.{leaf}.weight", name, e * per, tuple(shape[1:]), e))
            continue
        for module, half in parts:
            if half is None:
                pieces.append(Piece(f"{prefix}.{e}.{module}.weight", name, e * per,
                                    tuple(shape[1:]), e))
            else:
                rows = shape[1] // 2
                pieces.append(Piece(f"{prefix}.{e}.{module}.weight", name,
                                    e * per + half * (per // 2), (rows, *shape[2:]), e))
    return pieces


def _check_stacks(stacks: dict[str, TensorMeta], where: str) -> None:
    """One block's stacks agree on E; a fused gate_up_proj has an even number of rows and
    matches its down_proj ([E, 2I, H] and [E, H, I])."""
    by_block: dict[str, list[TensorMeta]] = {}
    for t in stacks.values():
        by_block.setdefault(t.name.rpartition(".")[0], []).append(t)
        if t.name.endswith(".gate_up_proj") and (len(t.shape) != 3 or t.shape[1] % 2):
            raise InputError(f"{where}: {t.name} {list(t.shape)} is not a fused gate and up "
                             f"stack [E, 2I, H]: its rows cannot be cut in two halves")
    for block, members in by_block.items():
        first = members[0]
        for t in members[1:]:
            if t.shape[0] != first.shape[0]:
                raise InputError(f"{where}: {t.name} holds {t.shape[0]} experts but "
                                 f"{first.name} holds {first.shape[0]}: expert counts differ "
                                 f"within {block}")
        fused = {t.name.rpartition(".")[2]: t for t in members}
        gu, down = fused.get("gate_up_proj"), fused.get("down_proj")
        if gu is not None and down is not None and len(down.shape) == 3 and (
                down.shape[1] != gu.shape[2] or 2 * down.shape[2] != gu.shape[1]):
            raise InputError(f"{where}: {down.name} {list(down.shape)} does not match "
                             f"{gu.name} {list(gu.shape)} ([E, H, I] for [E, 2I, H])")


class PerExpertSource(TensorSource):
    """``source`` with every grouped expert stack written as per-expert tensors under
    ``family``'s names (None: the generic rule, Qwen2-MoE's names for fused stacks), and
    every other name renamed as the family wants. ``experts`` (config.json's count, with
    ``config_path`` naming the file for messages) must equal every stack's E.

    Raises InputError naming the file or tensor on bad input; nothing is read but metadata.
    """

    def __init__(self, source: TensorSource, family: str | None = None,
                 experts: int | None = None, config_path: str | None = None):
        if family is not None and family not in FAMILIES:
            raise InputError(f"unknown expert naming family {family!r}; known: "
                             f"{', '.join(FAMILIES)}")
        self.source, self.family = source, family
        self.info = getattr(source, "info", None)
        where = getattr(self.info, "path", "the input")
        originals = source.tensors()
        stacks = {t.name: t for t in originals if expert_count(t.name, t.shape) is not None}
        _check_stacks(stacks, where)
        if experts is not None:
            for t in stacks.values():
                if t.shape[0] != experts:
                    raise InputError(f"{config_path or 'config.json'} declares {experts} "
                                     f"experts but {t.name} in {where} holds {t.shape[0]}")
        self._tensors: list[TensorMeta] = []
        self._where: dict[str, tuple[TensorMeta, int]] = {}  # output name -> (tensor, first element)
        for t in originals:
            if t.name in stacks:
                for p in stack_pieces(t.name, t.shape, family):
                    self._add(sliced_meta(t, p.name, p.shape, {"stack": t.name, "expert": p.expert}),
                              t, p.start, where)
            else:
                renamed = _rename(t.name, family)
                meta = t if renamed == t.name else TensorMeta(
                    renamed, t.shape, t.dtype, t.optimizer, t.states, kind=t.kind,
                    home=t.home, extra=t.extra)
                self._add(meta, t, 0, where)
        self._aliases = {_rename(a, family): _rename(o, family)
                         for a, o in source.aliases().items()}

    def _add(self, meta: TensorMeta, src: TensorMeta, start: int, where: str) -> None:
        if meta.name in self._where:
            raise InputError(f"{where}: {meta.name} would be written twice (from "
                             f"{self._where[meta.name][0].name} and {src.name}): the input holds "
                             f"experts both grouped and per expert")
        self._where[meta.name] = (src, start)
        self._tensors.append(meta)

    def tensors(self) -> list[TensorMeta]:
        return list(self._tensors)

    def aliases(self) -> dict[str, str]:
        return dict(self._aliases)

    def read(self, requests: Sequence[ReadRequest]) -> None:
        mapped = []
        for r in requests:
            src, start = self._where[r.name]
            mapped.append(ReadRequest(src.name, state_offset(src, r.state, start) + r.start,
                                      r.out, r.state))
        self.source.read(mapped)

    def check_readable(self, keys: Sequence[tuple[str, str]]) -> None:
        check = getattr(self.source, "check_readable", None)
        if check is not None:
            check(list(dict.fromkeys((self._where[n][0].name, s) for n, s in keys)))

    def close(self) -> None:
        self.source.close()


EXPERT_MODES = ("auto", "grouped", "per-expert")


def expert_naming(source: TensorSource, mode: str, config_path: str | None
                  ) -> tuple[TensorSource, str]:
    """What consolidate writes for ``source``'s grouped expert stacks under ``--experts
    mode``, and a note saying so ('' when the source has no stack).

    ``grouped``: as stored. ``per-expert``: ``PerExpertSource`` with the family of
    config.json's ``model_type`` (the generic rule when there is no config or the type is
    unknown). ``auto``: per-expert when config.json names a model type of a known family
    (what ``from_pretrained`` of that class reads), else as stored.
    """
    if mode not in EXPERT_MODES:
        raise InputError(f"--experts must be one of {', '.join(EXPERT_MODES)}, got {mode!r}")
    if not any(expert_count(t.name, t.shape) is not None for t in source.tensors()):
        return source, ""
    grouped = ("grouped expert stacks written as stored ({}); --experts per-expert writes "
               "one tensor per expert")
    if mode == "grouped":
        return source, grouped.format("--experts grouped")
    config = read_config(config_path) if config_path else {}
    model_type = config.get("model_type")
    family = family_of(model_type)
    if mode == "auto" and family is None:
        return source, grouped.format(
            f"config.json's model_type {model_type!r} has no per-expert naming here"
            if config_path else "no config.json beside the checkpoint")
    view = PerExpertSource(source, family, config_experts(config), config_path)
    named = f"{family} names" if family else "the generic per-expert rule"
    return view, f"expert stacks written per expert ({named})"


def find_config(paths: Sequence[str]) -> str | None:
    """config.json among the side files ``hf_extras.find_extras`` found, or None."""
    for p in paths:
        if os.path.basename(p) == "config.json":
            return p
    return None

