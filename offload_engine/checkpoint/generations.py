"""Checkpoint directories: generations, the ``latest`` pointer, and telling torn from whole.

```
<ckpt_dir>/
  latest                       text: the name of the newest committed generation
  step-00000030/               a committed generation (a zarr v3 group; tensor table in zarr.json)
    rank0/                     rank 0's arrays; its shard table in rank0/zarr.json
  step-00000040.partial/       a generation being written, or torn by a crash: never loaded
```

A generation is written under ``<name>.partial``, fsynced, then renamed to ``<name>`` (the
commit point: rename is atomic), and ``latest`` is replaced last (temp file, fsync,
rename). A crash at any moment leaves the previous generation and pointer intact.

``layout`` (which imports zarr and torch) is imported by the functions that read or write
generations, not with this module: every ``offload_engine.checkpoint`` import loads it,
the DeepSpeed consolidation included, which needs neither.
"""

from __future__ import annotations

import os

FORMAT = "offload-engine-checkpoint"
PARTIAL = ".partial"
LATEST = "latest"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, torn, corrupt or for another model."""


def generation_name(step: int) -> str:
    return f"step-{step:08d}"


def write_latest(ckpt_dir: str, name: str) -> None:
    """Point ``latest`` at generation ``name`` atomically (temp, fsync, rename, fsync dir)."""
    from ..layout.metadata import fsync_dir

    tmp = os.path.join(ckpt_dir, f".{LATEST}.tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(ckpt_dir, LATEST))
    fsync_dir(ckpt_dir)


def resolve(ckpt_dir: str, tag: str | None = None) -> str:
    """The directory of generation ``tag`` (default: the one ``latest`` names), checked to
    be committed. Errors name the file and what is wrong."""
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir}: no such checkpoint directory")
    if tag is None:
        pointer = os.path.join(ckpt_dir, LATEST)
        try:
            with open(pointer) as f:
                tag = f.read().strip()
        except FileNotFoundError:
            raise CheckpointError(f"{pointer}: missing; no checkpoint was committed in "
                                  f"{ckpt_dir} (or pass a tag)") from None
        if not tag or os.sep in tag:
            raise CheckpointError(f"{pointer}: does not name a generation ({tag!r})")
    if tag.endswith(PARTIAL):
        raise CheckpointError(f"{os.path.join(ckpt_dir, tag)}: a torn (uncommitted) generation")
    gen = os.path.join(ckpt_dir, tag)
    if not os.path.isdir(gen):
        torn = os.path.isdir(gen + PARTIAL)
        raise CheckpointError(f"{gen}: missing" + (" (only a torn .partial copy exists)" if torn else ""))
    manifest(gen)  # checks it
    return gen


def manifest(gen: str) -> dict:
    """The manifest of a committed generation (group attributes), checked."""
    from ..layout import MetadataError, NodeNotFoundError, read_group
    from ..layout.manifest import MANIFEST_VERSION

    try:
        attrs = read_group(gen)
    except (MetadataError, NodeNotFoundError) as e:
        raise CheckpointError(f"{gen}: not a checkpoint generation: {e}") from None
    if attrs.get("format") != FORMAT:
        raise CheckpointError(f"{os.path.join(gen, 'zarr.json')}: format is "
                              f"{attrs.get('format')!r}, not {FORMAT!r}")
    version = attrs.get("format_version", 0)
    if version != MANIFEST_VERSION:
        why = ("newer than this reader" if isinstance(version, int) and version > MANIFEST_VERSION
               else "not supported by this reader")
        raise CheckpointError(f"{os.path.join(gen, 'zarr.json')}: format version {version!r} "
                              f"is {why} (it reads version {MANIFEST_VERSION})")
    if attrs.get("committed") is not True:
        raise CheckpointError(f"{gen}: not committed (torn write)")
    for key in ("step", "world_size", "tensors", "checksums"):
        if key not in attrs:
            raise CheckpointError(f"{os.path.join(gen, 'zarr.json')}: manifest has no {key!r}")
    return attrs


def shard_tables(gen: str, ranks) -> dict[str, list[tuple[int, dict]]]:
    """The shard tables of ``ranks`` of a generation, merged: ``{tensor name: [(rank,
    shard entry), ...]}`` in rank order. Errors name the rank's zarr.json."""
    from ..layout import MetadataError, NodeNotFoundError
    from ..layout.manifest import read_shard_table

    out: dict[str, list[tuple[int, dict]]] = {}
    for r in ranks:
        try:
            table = read_shard_table(gen, r)
        except (MetadataError, NodeNotFoundError) as e:
            raise CheckpointError(f"{gen}: rank {r}'s shard table: {e}") from None
        for name, shard in table.items():
            out.setdefault(name, []).append((r, shard))
    return out
