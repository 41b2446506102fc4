"""Committing a generation written in the background, with files instead of collectives.

An asynchronous save finishes on each rank at its own time, in a background thread that
must not call into torch.distributed (the training loop owns the process group). So ranks
report through the staging directory (which every rank sees: it is where they write):

```
<gen>.partial/rank{r}/.done.json     rank r's arrays are written and fsynced: its summary
                                     (array dtypes and sizes, chunk checksums, AdamW steps)
<gen>.partial/rank{r}/.failed.json   rank r could not finish: {"error": "..."}
```

Rank 0 waits for every rank's report, writes the tensor table with the merged summaries
into the generation's zarr.json, removes the reports and commits (fsync, rename of
``<gen>.partial`` to ``<gen>``, ``latest`` last). The other ranks wait for ``<gen>`` to
appear, or for a failure report. A crash anywhere leaves ``<gen>.partial``: torn, never
loaded (formats/ours/generations.py).
"""

from __future__ import annotations

import json
import os
import time

from ..io import syscalls
from ..io.errors import FileIOError
from ..layout import create_group
from ..layout.manifest import rank_group
from ..layout.metadata import fsync_dir, write_json_atomic
from ..formats.errors import CheckpointError
from .generations import write_latest

DONE = ".done.json"
FAILED = ".failed.json"
POLL_S = 0.05


def _report(staging: str, rank: int, what: str) -> str:
    return os.path.join(staging, rank_group(rank), what)


def report_done(staging: str, rank: int, summary: dict) -> None:
    """Rank ``rank`` has written and fsynced everything; ``summary`` goes to rank 0."""
    write_json_atomic(_report(staging, rank, DONE), summary, compact=True)


def report_failed(staging: str, rank: int, error: BaseException) -> None:
    """Rank ``rank`` gives up on this generation (best effort: the disk may be the problem).
    Where the report cannot be written (a full disk), an empty one is made instead, which
    takes no data block: rank 0 still learns that this rank failed, instead of waiting."""
    path = _report(staging, rank, FAILED)
    try:
        syscalls.makedirs(os.path.dirname(path), exist_ok=True)
        write_json_atomic(path, {"error": f"{type(error).__name__}: {error}"})
    except OSError:
        try:
            os.close(syscalls.open_fd(path, os.O_WRONLY | os.O_CREAT | syscalls.NOFOLLOW
                                      | syscalls.CLOEXEC, 0o644))
        except OSError:
            pass


def _failure(staging: str, world: int) -> str | None:
    for r in range(world):
        path = _report(staging, r, FAILED)
        if os.path.exists(path):
            try:
                why = json.loads(syscalls.read_all(path)).get("error", "?")
            except (OSError, ValueError, AttributeError):
                why = "(an unreadable report: the disk may be full)"
            return f"{staging}: rank {r} failed to write its part: {why}"
    return None


def wait_for_ranks(staging: str, world: int, timeout_s: float) -> list[dict]:
    """Rank 0: every rank's summary, in rank order, once all reported done. Raises
    CheckpointError when a rank reports failure or ``timeout_s`` seconds pass."""
    deadline = time.monotonic() + timeout_s
    summaries: dict[int, dict] = {}
    while True:
        for r in range(world):
            if r in summaries:
                continue
            try:
                summaries[r] = json.loads(syscalls.read_all(_report(staging, r, DONE)))
            except FileNotFoundError:
                pass
        if len(summaries) == world:
            return [summaries[r] for r in range(world)]
        failure = _failure(staging, world)
        if failure:
            raise CheckpointError(failure)
        if time.monotonic() > deadline:
            missing = [r for r in range(world) if r not in summaries]
            raise CheckpointError(f"{staging}: ranks {missing} did not report their part "
                                  f"within {timeout_s:.0f} s; the generation stays uncommitted")
        time.sleep(POLL_S)


def commit(ckpt_dir: str, staging: str, final: str, attrs: dict, world: int) -> None:
    """Rank 0: write the generation's manifest ``attrs`` (sealed: it checksums itself, and
    records the checksums of every other metadata file), then make it the committed one."""
    create_group(staging, attrs, sealed=True)  # fsyncs ``staging`` after it lands
    for r in range(world):
        done = _report(staging, r, DONE)
        try:
            syscalls.unlink(done)
        except OSError as e:
            raise FileIOError(e.errno, "remove", done) from e
        fsync_dir(os.path.join(staging, rank_group(r)))
    try:
        syscalls.rename(staging, final)  # the commit point
    except OSError as e:
        raise FileIOError(e.errno, "rename", staging,
                          detail=f"{e.strerror} (committing it as {final})") from e
    fsync_dir(ckpt_dir)
    write_latest(ckpt_dir, os.path.basename(final))


def wait_for_commit(staging: str, final: str, world: int, timeout_s: float) -> None:
    """Ranks other than 0: block until rank 0 committed ``final`` (rename is atomic, so
    ``final`` exists exactly when it is committed) or a rank reported failure."""
    deadline = time.monotonic() + timeout_s
    while not os.path.isdir(final):
        failure = _failure(staging, world)
        if failure:
            raise CheckpointError(failure)
        if time.monotonic() > deadline:
            raise CheckpointError(f"{final}: not committed by rank 0 within {timeout_s:.0f} s")
        time.sleep(POLL_S)
