"""Every rank must see the generation's staging folder that rank 0 made: the checkpoint
directory has to be on a file system shared by all nodes (docs/multi-node.md).

Each rank writes its part under ``<gen>.partial`` and rank 0 commits what the others
reported there. On a directory local to each node (the same path on every node, but
different disks) the other nodes' parts would land in folders rank 0 never sees: rank 0
would wait for their reports until its timeout, and a later load on another node would find
nothing. So before anyone writes, rank 0 writes a marker with a fresh random token into the
staging folder, every rank reads it back, and all ranks learn (one all_gather) who could not:
they all raise the same clear error, and nothing is written.
"""

from __future__ import annotations

import os
import secrets
import socket

import torch.distributed as dist

from ..formats.errors import CheckpointError
from ..io import syscalls
from ..layout.metadata import write_text_atomic

MARKER = ".shared-check"


def write_marker(staging: str) -> str:
    """Rank 0: write a fresh token into ``staging``; returns it (I/O errors are raised)."""
    token = secrets.token_hex(16)
    write_text_atomic(os.path.join(staging, MARKER), token)
    return token


def sees_marker(staging: str, token: str) -> bool:
    """Whether this process reads rank 0's ``token`` in ``staging``."""
    try:
        return syscalls.read_all(os.path.join(staging, MARKER), limit=64).decode() == token
    except (OSError, UnicodeDecodeError):
        return False


def remove_marker(staging: str) -> None:
    """Rank 0, once every rank has looked: the marker is no part of the generation. A
    failure is ignored: the other ranks are already writing, and a stray dot-file in the
    generation is read by no one (raising on rank 0 alone would leave them waiting)."""
    try:
        syscalls.unlink(os.path.join(staging, MARKER))
    except OSError:
        pass


def check_shared(ckpt_dir: str, staging: str, token: str, rank: int, world: int, group=None) -> None:
    """Collective: every rank reads the marker; raise CheckpointError on every rank (naming
    the directory, the ranks and their hosts) unless all of them saw it."""
    mine = (sees_marker(staging, token), socket.gethostname())
    seen: list = [None] * world
    dist.all_gather_object(seen, mine, group=group)
    blind = [r for r, (ok, _) in enumerate(seen) if not ok]
    if rank == 0:
        if blind:  # the folder is rank 0's own: nothing was written in it but the marker
            try:
                syscalls.rmtree(staging)
            except OSError:
                pass
        else:
            remove_marker(staging)
    if blind:
        hosts = ", ".join(f"rank {r} on {seen[r][1]}" for r in blind[:8])
        more = f" and {len(blind) - 8} more" if len(blind) > 8 else ""
        raise CheckpointError(
            f"{ckpt_dir}: not saved: {hosts}{more} cannot see {os.path.join(staging, MARKER)}, "
            f"which rank 0 (on {seen[0][1]}) wrote; the checkpoint directory must be on a file "
            f"system shared by all nodes (every rank writes its part there and rank 0 "
            f"commits it). Keep the store on each node's local disk, the checkpoints on "
            f"shared storage")
