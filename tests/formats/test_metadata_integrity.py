"""Every byte of a committed generation's metadata is checksummed (docs/format.md,
"Integrity"): a single flipped bit anywhere in the manifest, a shard table, an array's
zarr.json or ``latest`` is an error naming that file, from every reader, before any value
is returned.

The checkpoint: W=2, a Muon matrix (``w``) and two AdamW vectors (``norm``, ``bias``)
with their state, written by tests/helpers/synthetic.py in format version 3. Each trial flips one
bit of one byte (a seeded sample over all metadata files; every bit of ``latest``), runs
the readers, and puts the byte back.

No flip can leave a file "meaning the same": the manifest's seal covers every byte before
it (whitespace included) and the seal itself is a fixed tail of 8 hex digits, checked by
pattern; shard tables and array zarr.json are compared byte for byte with their recorded
CRC-32C before they are parsed. ``latest`` has no checksum: any flip there makes a name
that is not a committed generation (or not a valid name at all), which readers refuse.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch

from helpers.forged import fresh_model, small_checkpoint
from helpers.synthetic import write_checkpoint
from helpers.inspect_fixtures import run_cli
from offload_engine.checkpoint import load_checkpoint
from offload_engine.formats.errors import CheckpointError
from offload_engine.formats.ours import OursSource
from offload_engine.layout.checksums import ChecksumError

GEN = "step-00000002"


def tensors() -> dict:
    """fresh_model's parameters (so load_checkpoint can take them) with optimizer state."""
    g = torch.Generator().manual_seed(3)
    return {
        "w": {"shape": [24, 8], "dtype": torch.float32, "optimizer": "muon",
              "states": {"param": torch.randn(24, 8, generator=g),
                         "momentum_buffer": torch.randn(24, 8, generator=g)}},
        "norm": {"shape": [8], "dtype": torch.float32, "optimizer": "adamw",
                 "states": {"param": torch.randn(8, generator=g),
                            "exp_avg": torch.randn(8, generator=g),
                            "exp_avg_sq": torch.rand(8, generator=g)}},
        "bias": {"shape": [24], "dtype": torch.float32, "optimizer": "adamw",
                 "states": {"param": torch.randn(24, generator=g),
                            "exp_avg": torch.randn(24, generator=g),
                            "exp_avg_sq": torch.rand(24, generator=g)}},
    }


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("integrity") / "ck")
    os.makedirs(root)
    write_checkpoint(root, tensors(), 2, 2, chunk_bytes=4096)
    return root


def metadata_files(root: str) -> list[str]:
    """Every metadata file of the checkpoint: latest and each zarr.json (group, rank
    groups, arrays)."""
    out = [os.path.join(root, "latest")]
    for d, _, files in os.walk(os.path.join(root, GEN)):
        out += [os.path.join(d, f) for f in files if f == "zarr.json"]
    return sorted(out)


class Flipped:
    """Bit ``bit`` of byte ``pos`` of ``path`` flipped while inside the ``with``."""

    def __init__(self, path: str, pos: int, bit: int):
        self.path, self.pos, self.bit = path, pos, bit

    def _xor(self):
        with open(self.path, "r+b") as f:
            f.seek(self.pos)
            b = f.read(1)[0]
            f.seek(self.pos)
            f.write(bytes([b ^ (1 << self.bit)]))

    def __enter__(self):
        self._xor()

    def __exit__(self, *exc):
        self._xor()


def read_everything(root: str) -> None:
    with OursSource.open_checkpoint(root) as src:
        for t in src.tensors():
            for state, sm in t.states.items():
                src.read_state(t.name, state, 0, torch.empty(sm.numel, dtype=sm.dtype.torch))


def refused_by_python(fn, file: str) -> bool:
    try:
        fn()
    except (CheckpointError, ChecksumError) as e:
        return file in str(e)
    return False


def refused_by_cli(args, capsys, file: str) -> bool:
    rc, out, err = run_cli(args, capsys)
    return rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err \
        and file in err


def readers(root: str, tmp: str, capsys):
    """(name, fn(file) -> refused naming file) for every reader of a checkpoint."""
    # one model for every trial: a refused load stops before it writes anything
    model, opt = fresh_model(os.path.join(tmp, "load-state"), seed=1)
    readers.close = opt.close
    return [
        ("OursSource", lambda file: refused_by_python(lambda: read_everything(root), file)),
        ("load_checkpoint", lambda file: refused_by_python(
            lambda: load_checkpoint(root, model, opt), file)),
        ("inspect --stats", lambda file: refused_by_cli(
            ["inspect", root, "--stats"], capsys, file)),
        ("export", lambda file: refused_by_cli(
            ["export", root, "bias", "--out", os.path.join(tmp, "bias.npy")], capsys, file)),
        ("consolidate --verify", lambda file: refused_by_cli(
            ["consolidate", root, os.path.join(tmp, "out"), "--verify"], capsys, file)),
    ]


def flips(root: str, n: int, seed: int) -> list[tuple[str, int, int]]:
    """Every bit of ``latest`` and a seeded sample of ``n`` (file, byte, bit) elsewhere,
    spread over the files by their sizes."""
    files = metadata_files(root)
    latest = os.path.join(root, "latest")
    out = [(latest, p, b) for p in range(os.path.getsize(latest)) for b in range(8)]
    others = [(f, p) for f in files if f != latest for p in range(os.path.getsize(f))]
    rng = random.Random(seed)
    out += [(f, p, rng.randrange(8)) for f, p in rng.sample(others, min(n, len(others)))]
    return out


def test_intact_checkpoint_reads(ckpt, tmp_path, capsys):
    """The baseline: every reader accepts the checkpoint as written."""
    read_everything(ckpt)
    model, opt = fresh_model(str(tmp_path / "s"), seed=1)
    try:
        assert load_checkpoint(ckpt, model, opt) == 2
        assert torch.equal(model.w.detach(), tensors()["w"]["states"]["param"])
    finally:
        opt.close()
    for args in (["inspect", ckpt, "--stats"], ["export", ckpt, "bias", "--out",
                                                  str(tmp_path / "b.npy")],
                 ["consolidate", ckpt, str(tmp_path / "out"), "--verify"]):
        rc, out, err = run_cli(args, capsys)
        assert rc == 0, err


def check_flips(root: str, tmp: str, capsys, trials) -> dict[str, tuple[int, int]]:
    """{reader: (detected, tried)}; asserts every flip was detected by every reader."""
    counts, missed = {}, []
    try:
        counted = _count(readers(root, tmp, capsys), root, trials, counts, missed)
    finally:
        readers.close()
    print("detected/tried:", counted)
    assert not missed, missed[:20]
    return counted


def _count(all_readers, root, trials, counts, missed):
    for name, refused in all_readers:
        detected = 0
        for path, pos, bit in trials:
            with Flipped(path, pos, bit):
                ok = refused(path)
            detected += ok
            if not ok:
                missed.append((name, os.path.relpath(path, root), pos, bit))
        counts[name] = (detected, len(trials))
    return counts


def test_every_file_every_reader_sample(ckpt, tmp_path, capsys):
    """Quick: 60 sampled flips (and every bit of latest) through all five readers."""
    check_flips(ckpt, str(tmp_path), capsys, flips(ckpt, 60, seed=1))


@pytest.mark.slow
def test_two_thousand_flips(ckpt, tmp_path, capsys):
    """2,000 sampled flips across all metadata files (and every bit of latest), each
    through all five readers."""
    counts = check_flips(ckpt, str(tmp_path), capsys, flips(ckpt, 2000, seed=14))
    assert all(tried >= 2000 for _, tried in counts.values())


def test_real_save_checksums_all_its_metadata(tmp_path, capsys):
    """save_checkpoint (not the test writer) records every zarr.json of the generation and
    seals the manifest: a flipped bit in its shard table or an array's metadata stops load
    and inspect --stats, naming the file."""
    ck = small_checkpoint(str(tmp_path))
    gen = os.path.join(ck, GEN)
    with open(os.path.join(gen, "zarr.json"), "rb") as f:
        raw = f.read()
    attrs = json.loads(raw)["attributes"]
    assert attrs["format_version"] == 4 and raw.endswith(b'"}}\n')
    on_disk = {os.path.relpath(f, gen) for f in metadata_files(ck)} - {"zarr.json",
                                                                     os.path.join("..", "latest")}
    assert set(attrs["metadata_checksums"]) == on_disk
    model, opt = fresh_model(str(tmp_path / "s"), seed=1)
    try:
        for name in ("rank0/zarr.json", "rank0/param/zarr.json", "zarr.json"):
            path = os.path.join(gen, name)
            with Flipped(path, os.path.getsize(path) // 2, 0):
                with pytest.raises((CheckpointError, ChecksumError), match=path):
                    load_checkpoint(ck, model, opt)
                assert refused_by_cli(["inspect", ck, "--stats"], capsys, path)
        assert load_checkpoint(ck, model, opt) == 2  # put back: loads
    finally:
        opt.close()


def test_version_2_checkpoint_reads_and_says_metadata_unchecked(tmp_path, capsys):
    """A checkpoint written before metadata checksums (version 2) still reads, with its
    chunks verified; inspect says its metadata is not covered."""
    root = str(tmp_path / "v2")
    os.makedirs(root)
    write_checkpoint(root, tensors(), 2, 2, chunk_bytes=4096, format_version=2)
    rc, out, err = run_cli(["inspect", root, "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["summary"]["format_version"] == 2
    assert any("metadata" in n and "is not" in n for n in doc["summary"]["notes"])
    read_everything(root)
    chunk = os.path.join(root, GEN, "rank1", "exp_avg", "c", "0")
    with Flipped(chunk, 5, 2):
        rc, out, err = run_cli(["inspect", root, "--stats"], capsys)
        assert rc == 2 and chunk in err and "checksum mismatch" in err


def test_sealed_manifest_rewritten_without_seal_is_refused(ckpt, tmp_path, capsys):
    """A version 3 manifest rewritten by a tool that drops the seal (or reorders the
    attributes so it is not last) is refused, naming the file: its metadata would
    otherwise go unchecked."""
    root = str(tmp_path / "ck")
    shutil.copytree(ckpt, root)
    path = os.path.join(root, GEN, "zarr.json")
    for edit in ("drop", "reorder"):
        with open(path) as f:
            doc = json.load(f)
        seal = doc["attributes"].pop("manifest_crc32c")
        if edit == "reorder":
            doc["attributes"] = {"manifest_crc32c": seal, **doc["attributes"]}
        with open(path, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
            f.write("\n")
        rc, out, err = run_cli(["inspect", root], capsys)
        assert rc == 2 and path in err and "manifest_crc32c" in err, err
        shutil.copy(os.path.join(ckpt, GEN, "zarr.json"), path)
