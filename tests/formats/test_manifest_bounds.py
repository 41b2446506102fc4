"""A manifest's declared sizes are checked against what the group holds before anything
is allocated or iterated by them (formats/ours/bounds.py): a forged world_size of 10**9
made plain inspect (metadata only) build a list of 10**9 ranks (10 GB, never finishing),
and export and diff the same; a forged shape of 10**12 made export allocate 4 TB and exit
1 with a traceback. The forged manifests here are sealed again after the edit (as a
forger would) or are version 2 (no seal), so the checksums are not what stops them.

The commands run in a child process with 2 GiB of data memory and a time limit, so a
regression fails the test instead of exhausting the machine."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from helpers.synthetic import reseal, write_checkpoint
from helpers.inspect_fixtures import make_live_store, model_tensors
from helpers.paths import ROOT

pytestmark = pytest.mark.multiprocess  # every test runs the CLI in a child with limits

GEN = "step-00000007"


def _limit():
    resource.setrlimit(resource.RLIMIT_DATA, (2 << 30, 2 << 30))
    # and no file over 1 GiB: a regression preallocating terabytes fails (EFBIG) instead
    # of filling the disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 30, 1 << 30))


def cli(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "offload_engine.cli.main", *map(str, args)],
                          capture_output=True, text=True, timeout=120, env=env,
                          preexec_fn=_limit)


def one_line_error(p: subprocess.CompletedProcess, *needles: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr
    for n in needles:
        assert n in p.stderr, (n, p.stderr)


def edit_manifest(group: str, edit, version: int) -> str:
    path = os.path.join(group, "zarr.json")
    with open(path) as f:
        doc = json.load(f)
    edit(doc["attributes"])
    with open(path, "w") as f:
        f.write(json.dumps(doc, separators=(",", ":")) + "\n")
    if version >= 3:
        reseal(group)
    return path


def checkpoint(tmp_path, version: int) -> tuple[str, str]:
    root = str(tmp_path / f"v{version}")
    os.makedirs(root)
    gen = write_checkpoint(root, model_tensors(), 2, 7, chunk_bytes=4096,
                           format_version=version)
    return root, gen


@pytest.mark.parametrize("version", [2, 3])
def test_forged_world_size(tmp_path, version):
    root, gen = checkpoint(tmp_path, version)

    def forge(a):
        a["world_size"] = 10**9
        if version >= 3:  # what reseal records: the tables there are
            a.pop("metadata_checksums", None)
    path = edit_manifest(gen, forge, version)
    other = str(tmp_path / "other")
    write_checkpoint(other, model_tensors(), 2, 7, chunk_bytes=4096)
    for args in (["inspect", root], ["inspect", root, "--stats"],
                 ["export", root, "emb.weight", "--out", tmp_path / "e.npy"],
                 ["diff", root, other]):
        p = cli(*args)
        if version >= 3 and p.returncode == 2 and "metadata_checksums" in p.stderr:
            continue  # the checksum table of a sealed manifest lists every rank: also refused
        one_line_error(p, path, "world_size is 1000000000")


def test_forged_world_size_of_a_live_store(tmp_path):
    """A live store holds one rank: its world size sizes nothing, whatever it says."""
    store, _ = make_live_store(tmp_path / "store", world_size=2)
    edit_manifest(store, lambda a: a.update(world_size=10**9, rank=1), 2)
    p = cli("inspect", store)
    assert p.returncode == 0, p.stderr
    p = cli("inspect", store, "--stats")  # its shard table holds more rows than 1/10**9th
    one_line_error(p, os.path.join(store, "rank1", "zarr.json"), "rows")


@pytest.mark.parametrize("version", [2, 3])
def test_forged_shape(tmp_path, version):
    root, gen = checkpoint(tmp_path, version)
    path = edit_manifest(gen, lambda a: a["tensors"]["emb.weight"].update(shape=[10**12, 16]),
                         version)
    other = str(tmp_path / "other")
    write_checkpoint(other, model_tensors(), 2, 7, chunk_bytes=4096)
    for args in (["inspect", root],
                 ["export", root, "emb.weight", "--out", tmp_path / "e.pt"],
                 ["export", root, "emb.weight", "--out", tmp_path / "e.npy"],
                 ["diff", root, other]):
        one_line_error(cli(*args), path, "tensor 'emb.weight'", "elements on rank 0")


def test_forged_rank_of_a_live_store(tmp_path):
    store, _ = make_live_store(tmp_path / "store", world_size=2)
    path = edit_manifest(store, lambda a: a.update(rank=2), 2)
    one_line_error(cli("inspect", store), path, "'rank' must be an integer in [0, 2)")


def test_forged_shape_with_arrays_and_tables_to_match(tmp_path):
    """The tensor table, the arrays' numel and the shard tables all forged to agree on
    2 * 10**11 rows: only each array's own zarr.json disagrees. export and consolidate
    open every array a tensor needs (check_readable) before they size a buffer or a file
    by its shape, and refuse, naming the array."""
    root, gen = checkpoint(tmp_path, 2)
    rows, name = 2 * 10**11, "emb.weight"

    def forge_top(a):
        a["tensors"][name]["shape"] = [rows, 16]
        for entry in a["arrays"].values():
            entry["numel"] += 2 * 10**12
    edit_manifest(gen, forge_top, 2)
    for r in range(2):
        def forge_table(a, r=r):
            shard = a["shards"][name]
            shard.update(row_start=r * rows // 2, rows=rows // 2, numel=rows // 2 * 16)
        edit_manifest(os.path.join(gen, f"rank{r}"), forge_table, 2)
    for args in (["export", root, name, "--out", tmp_path / "e.pt"],
                 ["export", root, name, "--out", tmp_path / "e.npy"],
                 ["consolidate", root, tmp_path / "out"]):
        one_line_error(cli(*args), os.path.join(gen, "rank0"), "the manifest says")
    assert not os.path.exists(tmp_path / "e.pt") and not os.path.exists(tmp_path / "e.npy")
