"""Reading what consolidate wrote (safetensors files, an index, recorded aliases) and comparing
it bit for bit with an expected file; a TensorSource over tensors in memory."""

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from offload_engine.dtypes import dtype as as_dtype
from offload_engine.formats import TensorMeta
from offload_engine.offline.casts import as_torch_view


def load_output(out_dir):
    """{name: tensor} over every output file, aliases resolved through the recorded metadata."""
    index_path = os.path.join(out_dir, "model.safetensors.index.json")
    if os.path.exists(index_path):
        index = json.load(open(index_path))
        files = sorted(set(index["weight_map"].values()))
        aliases = {k: v for k, v in index["metadata"].items() if k != "total_size"}
    else:
        files, aliases = ["model.safetensors"], {}
    tensors = {}
    for name in files:
        with safe_open(os.path.join(out_dir, name), framework="pt") as f:
            meta = f.metadata()
            assert meta["format"] == "pt"
            aliases.update({k: v for k, v in meta.items() if k != "format"})
            for key in f.keys():
                assert key not in tensors
                tensors[key] = f.get_tensor(key)
    return tensors, aliases


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_matches_expected(out_dir, expected_file, cast=None):
    got, aliases = load_output(out_dir)
    expected = load_file(expected_file)
    for name, want in expected.items():
        have = got[name] if name in got else got[aliases[name]]
        if cast is not None and want.is_floating_point():
            want = want.to(cast)
        assert have.dtype == want.dtype and have.shape == want.shape, name
        assert torch.equal(bits(have), bits(want)), name
    extra = (set(got) | set(aliases)) - set(expected)
    assert not extra or extra == {"frozen.weight", "frozen.bias"}, extra  # see test_zero1_keeps_frozen
    return got, aliases


class DictSource:
    """A TensorSource over in-memory tensors: any reader of the interface plugs in."""

    def __init__(self, tensors, aliases=None):
        self.data = tensors
        self._aliases = aliases or {}
        self.closed = False

    def tensors(self):
        return [TensorMeta.single(n, tuple(t.shape), t.dtype,
                                  "buffer" if not t.is_floating_point() else "param")
                for n, t in self.data.items()]

    def aliases(self):
        return self._aliases

    def read(self, requests):
        for r in requests:
            t = self.data[r.name]
            as_torch_view(r.out, as_dtype(t.dtype)).copy_(t.reshape(-1)[r.start:r.start + len(r.out)])

    def close(self):
        self.closed = True
