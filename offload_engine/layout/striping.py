"""Striping: the chunk files of one array spread round-robin over several NVMe directories.

Chunk ``i`` of an array lives on directory ``i % n`` of the ``n`` stripe directories. The
first directory holds the zarr group; a chunk placed elsewhere is a file at
``<stripe dir>/stripes/<array>/c/<i>`` with a symlink at its zarr key ``<array>/c/<i>``, so
zarr-python and tensorstore find every chunk where the format says it is (docs/format.md).
"""

from __future__ import annotations

import os

from ..io import syscalls
from ..io.errors import FileIOError
from .flat_array import FlatArray


def stripe_index(chunk: int, stripes: int) -> int:
    """The stripe directory (0-based) that holds chunk ``chunk`` of ``stripes`` directories."""
    return chunk % stripes


def striped_chunk_path(stripe_dir: str, array_name: str, chunk: int) -> str:
    """Where chunk ``chunk`` of array ``array_name`` lives on a stripe directory other than the first."""
    return os.path.join(stripe_dir, "stripes", array_name, "c", str(chunk))


def stripe_chunks(flat: FlatArray, array_name: str, stripe_dirs: list[str]) -> None:
    """Link every chunk of ``flat`` (array ``array_name`` of a group in ``stripe_dirs[0]``)
    that belongs on another stripe directory to its file there.

    Idempotent: existing links are kept, and a plain chunk file already at a zarr key (from a
    run with fewer directories) stays where it is. Chunk files are not created here: a link
    may dangle until the chunk is first written, and then reads as absent (fill value).
    """
    n = len(stripe_dirs)
    if n <= 1:
        return
    for chunk in range(flat.nchunks):
        stripe = stripe_index(chunk, n)
        if stripe == 0:
            continue
        link = flat.chunk_path(chunk)
        target = striped_chunk_path(stripe_dirs[stripe], array_name, chunk)
        try:
            for directory in (os.path.dirname(target), os.path.dirname(link)):
                syscalls.makedirs(directory, exist_ok=True)
            if not os.path.islink(link):
                if os.path.exists(link):  # a plain chunk from an unstriped run: keep it there
                    continue
                syscalls.symlink(target, link)
        except OSError as e:
            raise FileIOError(e.errno, "link", link,
                              detail=f"{e.strerror} (striping chunk {chunk} to {target})") from e


__all__ = ["stripe_chunks", "stripe_index", "striped_chunk_path"]
