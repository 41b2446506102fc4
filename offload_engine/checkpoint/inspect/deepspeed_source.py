"""DeepSpeed ZeRO-1/2/3 checkpoints: parameters with their fp32 master weights and Adam
moments, frozen parameters and buffers. No deepspeed import, no plain pickle: structure
comes from the restricted unpickler (a pickle naming any other global is refused, nothing
runs), data by byte range.

States: trainable parameters have ``master`` (the fp32 partitions, read by the same code
as ``consolidate``) and, when saved, ``exp_avg`` / ``exp_avg_sq``; frozen parameters and
buffers have ``param``.
"""

from __future__ import annotations

import os

import torch

from ..consolidate import ReadRequest
from ..deepspeed import DeepSpeedSource
from ..dtypes import to_torch
from ..deepspeed.optim_states import DeepSpeedOptimStates
from .model import SourceInfo, StateMeta, TensorMeta
from .source import InspectSource, itemsize


class DeepSpeedInspectSource(InspectSource):
    def __init__(self, root: str, tag: str | None = None):
        self._src = DeepSpeedSource(root, tag=tag)
        try:
            self._states = DeepSpeedOptimStates(self._src.tag_dir)
        except BaseException:
            self._src.close()
            raise
        st = self._states
        tensors = []
        for info in self._src.tensors():
            numel = info.numel
            dtype = to_torch(info.dtype)  # the readers speak numpy dtypes, inspection torch
            if info.kind == "param":
                states = {s: StateMeta(to_torch(st.dtypes[s]), numel, st.bytes_by_rank[(info.name, s)])
                          for s in st.states}
                tensors.append(TensorMeta(info.name, info.shape, dtype, st.optimizer, states))
            else:
                states = {"param": StateMeta(dtype, numel, {None: numel * itemsize(dtype)})}
                tensors.append(TensorMeta(info.name, info.shape, dtype, None, states,
                                          kind=info.kind))
        self._tensors = tensors
        self._kinds = {t.name: t.kind for t in tensors}
        files = sorted({p for p in st.paths} | _model_files(self._src.tag_dir))
        step = st.global_steps if isinstance(st.global_steps, int) else None
        self.info = SourceInfo(
            kind="deepspeed", path=os.path.abspath(root),
            format=f"DeepSpeed ZeRO-{self._src.stage}" + (" bf16" if self._src.bf16 else "")
            + f", deepspeed {self._src.ds_version}", step=step,
            generation=self._src.tag, world_size=self._src.world_size,
            files=[(f, os.path.getsize(f)) for f in files])
        if "exp_avg" not in st.states:
            self.info.notes.append("no Adam moments in the optimizer files")

    def tensors(self) -> list[TensorMeta]:
        return self._tensors

    def aliases(self) -> dict[str, str]:
        return self._src.aliases()

    def read(self, name: str, state: str, start: int, out: torch.Tensor) -> None:
        kind = self._kinds.get(name)
        if kind is None:
            raise KeyError(f"no tensor {name!r} in {self._src.tag_dir}")
        if (kind == "param" and state == "master") or (kind != "param" and state == "param"):
            self._src.read([ReadRequest(name, start, out)])
        else:
            self._states.read(name, state, start, out)

    def close(self) -> None:
        self._states.close()
        self._src.close()


def _model_files(tag_dir: str) -> set[str]:
    return {os.path.join(tag_dir, f) for f in os.listdir(tag_dir) if f.endswith("_model_states.pt")}
