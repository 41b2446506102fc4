"""How consolidate moves bytes: page-aligned windows written with O_DIRECT, headers inside
the first window(s), and the DeepSpeed reader's runs cut into pieces read in parallel."""

import os

import pytest
import torch

from offload_engine.formats import ReadRequest
from offload_engine.formats.deepspeed import DeepSpeedSource
from offload_engine.io import AsyncFileIO
from offload_engine.offline import consolidate as consolidate_mod
from offload_engine.offline.consolidate import consolidate, iter_windows, plan_output, verify_output

from helpers.consolidate_outputs import DictSource, bits, load_output
from helpers.deepspeed_checkpoints import Z3, moment_spans, write_synthetic


def _windows(source, window, dtype=torch.float32, max_shard=10**9):
    plans, _, infos = plan_output(source, max_shard, dtype)
    paths = [p.filename for p in plans]
    return plans, list(iter_windows(plans, paths, infos, window))


def _check_cover(plans, wins):
    """Windows tile each file exactly, in order; header bytes sit where the file starts."""
    for plan in plans:
        mine = [w for w in wins if w.path == plan.filename]
        pos = 0
        for w in mine:
            assert w.file_offset == pos
            if pos < plan.data_start:
                assert w.header == plan.header[pos:pos + len(w.header)]
                assert len(w.header) == min(w.nbytes, plan.data_start - pos)
            else:
                assert w.header == b""
            pos += w.nbytes
        assert pos == plan.file_size


def test_windows_start_on_window_boundaries():
    g = torch.Generator().manual_seed(0)
    src = DictSource({"a": torch.randn(5000, generator=g), "b": torch.randn(3, 700, generator=g),
                      "ids": torch.arange(9, dtype=torch.int64), "h": torch.randn(33, generator=g).half()})
    window = 8192
    plans, wins = _windows(src, window)
    _check_cover(plans, wins)
    for w in wins[:-1]:
        assert w.file_offset % window == 0 and w.nbytes == window
    assert wins[0].header and all(not w.header for w in wins[1:])


def test_a_header_larger_than_a_window_spans_windows():
    src = DictSource({f"t{i:04d}": torch.full((2,), float(i)) for i in range(400)})
    plans, wins = _windows(src, 4096)
    assert plans[0].data_start > 2 * 4096
    assert len([w for w in wins if w.header]) >= 3
    _check_cover(plans, wins)
    assert all(w.nbytes <= 4096 for w in wins)


def test_cast_windows_end_on_pages():
    """fp32 -> bf16 fills the staging buffer before the window: windows still end on 4096."""
    g = torch.Generator().manual_seed(0)
    src = DictSource({"a": torch.randn(100_000, generator=g), "b": torch.randn(7, generator=g)})
    plans, wins = _windows(src, 64 * 1024, dtype=torch.bfloat16)
    _check_cover(plans, wins)
    assert len(wins) > 3
    for w in wins[:-1]:
        assert (w.file_offset + w.nbytes) % 4096 == 0
        assert w.stage_bytes <= 64 * 1024


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_windows_are_written_with_o_direct(tmp_path, monkeypatch, dtype):
    stats = []
    real_close = AsyncFileIO.close

    def close(self):
        stats.append(self.stats)
        real_close(self)

    monkeypatch.setattr(AsyncFileIO, "close", close)
    g = torch.Generator().manual_seed(0)
    params = {"big": torch.randn(700, 1000, generator=g), "odd": torch.randn(13, generator=g)}
    write_synthetic(tmp_path / "ck", 3, 2, params, sub_group_numel=300_000)
    out = tmp_path / "out"
    with DeepSpeedSource(str(tmp_path / "ck")) as src:
        consolidate(src, str(out), dtype=dtype, window_bytes=256 * 1024, max_shard_bytes=10**9)
        assert verify_output(src, str(out), dtype=dtype) == []
    got, _ = load_output(out)
    for name, want in params.items():
        assert torch.equal(bits(got[name]), bits(want.to(dtype))), name
    if consolidate_mod._direct_ok(str(tmp_path)):
        assert stats[-1].direct_pieces > 0
        assert stats[-1].buffered_pieces <= 1  # the file's last partial page
    assert not [n for n in os.listdir(out) if n.startswith(".")]  # no probe or temp left


def test_no_direct_where_the_file_system_refuses_it(tmp_path, monkeypatch):
    monkeypatch.setattr(consolidate_mod, "_direct_ok", lambda d: False)
    src = DictSource({"w": torch.arange(50_000, dtype=torch.float32)})
    out = tmp_path / "out"
    consolidate(src, str(out), window_bytes=64 * 1024)
    assert verify_output(src, str(out)) == []


# -- the reader: pieces in parallel, moments never read --------------------------------------------

@pytest.mark.parametrize("piece", [1, 40, 4096])
def test_reader_pieces_match_whole_reads(piece):
    with DeepSpeedSource(Z3) as whole, DeepSpeedSource(Z3) as cut:
        cut.reader.max_piece = piece
        cut.reader.trace = []
        for info in whole.tensors():
            a = torch.empty(info.numel, dtype=info.dtype.torch)
            b = torch.empty(info.numel, dtype=info.dtype.torch)
            whole.read([ReadRequest(info.name, 0, a)])
            cut.read([ReadRequest(info.name, 0, b)])
            assert torch.equal(bits(a), bits(b)), info.name
        assert cut.reader.trace and all(n <= piece for _, _, n in cut.reader.trace)
        moments = {pt.path: moment_spans(pt) for pt in cut._optims}
        for file, offset, nbytes in cut.reader.trace:
            for lo, hi in moments.get(cut.reader.paths[file], []):
                assert offset + nbytes <= lo or offset >= hi


def test_one_window_reads_in_parallel_pieces(tmp_path):
    g = torch.Generator().manual_seed(0)
    write_synthetic(tmp_path / "ck", 3, 2, {"w": torch.randn(600, 1000, generator=g)}, sub_group_numel=10**6)
    with DeepSpeedSource(str(tmp_path / "ck")) as src:
        src.reader.max_piece = 256 * 1024
        src.reader.trace = []
        info = src.tensors()[0]
        out = torch.empty(info.numel, dtype=info.dtype.torch)
        src.read([ReadRequest(info.name, 0, out)])
        per_file = {}
        for file, _, n in src.reader.trace:
            per_file.setdefault(file, []).append(n)
        # 2.4 MB over 2 ranks: several pieces per rank file, none above the limit
        assert len(per_file) == 2 and all(len(v) >= 4 for v in per_file.values())
        assert max(n for v in per_file.values() for n in v) <= 256 * 1024
