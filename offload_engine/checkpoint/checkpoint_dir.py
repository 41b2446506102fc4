"""Writing a checkpoint directory: the staging folder, the ranks' reports in it, the commit
and ``latest``. The names are ``layout/checkpoint_names.py``; reading the directory back
(which generation ``latest`` names, torn or whole) is ``formats/ours/checkpoint_listing.py``;
``keep_last`` is ``retention.py``.

A generation is written under ``<gen>.partial``, fsynced, then renamed to ``<gen>`` (the
commit point: rename is atomic), and ``latest`` is replaced last (temp file, fsync,
rename). A crash at any moment leaves ``<gen>.partial`` (torn, never loaded) and the
previous generation and pointer intact.

A save finishes on each rank at its own time, in a background thread that must not call
into torch.distributed (the training loop owns the process group). So ranks report through
the staging folder (which every rank sees: it is where they write):

```
<gen>.partial/rank{r}/.done.json     rank r's arrays are written and fsynced: its summary
                                     (array dtypes and sizes, chunk checksums, AdamW steps)
<gen>.partial/rank{r}/.failed.json   rank r could not finish: {"error": "..."}
```

Rank 0 waits for every rank's report, writes the tensor table with the merged summaries
into the generation's zarr.json, removes the reports and commits. The other ranks wait for
``<gen>`` to appear, or for a failure report.
"""

from __future__ import annotations

import json
import logging
import os
import time

from ..formats.errors import CheckpointError, CheckpointExistsError
from ..io import syscalls
from ..io.errors import FileIOError
from ..layout import create_group
from ..layout.checkpoint_names import LATEST, read_latest, superseded_path
from ..layout.manifest import rank_group
from ..layout.metadata import fsync_dir, write_json_atomic, write_text_atomic

log = logging.getLogger(__name__)

DONE = ".done.json"
FAILED = ".failed.json"
POLL_S = 0.05


# -- staging --------------------------------------------------------------------------------------
def prepare_staging(ckpt_dir: str, final: str, staging: str, step: int) -> BaseException | None:
    """Make ``<gen>.partial`` (dropping one torn by an earlier crash, and setting aside a
    generation of the same name that ``latest`` does not name: ``set_aside_orphan``); the
    error, if it cannot (rank 0 broadcasts it so that no rank waits for a save that never
    starts)."""
    if os.path.exists(final):
        problem = set_aside_orphan(ckpt_dir, final, step)
        if problem is not None:
            return problem
    where = ("mkdir", ckpt_dir)
    try:
        # each folder made here has its parent fsynced: else a power cut after the commit
        # could lose the checkpoint folder, latest and every generation with it
        syscalls.makedirs(ckpt_dir, exist_ok=True, durable=True)
        if os.path.lexists(staging):
            where = ("remove", staging)
            syscalls.rmtree(staging)  # torn by an earlier crash: never loadable, safe to drop
        where = ("mkdir", staging)
        syscalls.makedirs(staging)
    except OSError as e:
        return FileIOError(e.errno, *where, detail=e.strerror)
    return None


def set_aside_orphan(ckpt_dir: str, final: str, step: int) -> BaseException | None:
    """``final`` exists. When ``latest`` names it, saving that step again is an error
    (returned: CheckpointExistsError). Otherwise it is an orphan: committed by a run that
    crashed between the rename and the update of ``latest``, or left by a timeline that
    ``latest`` was rolled back from. Resuming from ``latest`` saves this step again, so the
    orphan is renamed to ``<name>.superseded-<k>`` (kept, never loaded: no reader follows
    that name unless asked for it) with a warning naming it, and None is returned. An
    unreadable ``latest`` is an error: what it should name is unknown, so nothing is moved."""
    name = os.path.basename(final)
    try:
        current = read_latest(ckpt_dir, CheckpointError)
    except CheckpointError as e:
        if not os.path.lexists(os.path.join(ckpt_dir, LATEST)):
            current = None  # the first save crashed before writing latest
        else:
            return CheckpointExistsError(f"{final}: a checkpoint of step {step} is already "
                                         f"committed, and latest cannot be read to tell "
                                         f"whether it is the current one ({e})")
    if current == name:
        return CheckpointExistsError(f"{final}: a checkpoint of step {step} is already "
                                     f"committed (and latest names it)")
    k = 1
    while os.path.lexists(superseded_path(final, k)):
        k += 1
    aside = superseded_path(final, k)
    try:
        syscalls.rename(final, aside)
    except OSError as e:
        return FileIOError(e.errno, "rename", final, detail=e.strerror)
    fsync_dir(ckpt_dir)
    log.warning("%s was committed but latest names %s (a crash between the commit and the "
                "update of latest, or a rollback): kept as %s, which is never loaded; "
                "saving step %d again", final, repr(current) if current else "nothing",
                aside, step)
    return None


# -- the ranks' reports ---------------------------------------------------------------------------
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


# -- the commit -----------------------------------------------------------------------------------
def commit(ckpt_dir: str, staging: str, final: str, attrs: dict | None, world: int) -> None:
    """Rank 0: write the generation's manifest ``attrs`` (sealed: it checksums itself, and
    records the checksums of every other metadata file; None where the writer streamed the
    manifest itself, ``offline/import_writer.py``), then make it the committed one: remove
    the reports, fsync, rename ``staging`` to ``final``, fsync, ``latest`` last."""
    if attrs is not None:
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
    """Ranks other than 0: block until rank 0 committed ``final`` and ``latest`` names it,
    or a rank reported failure; then fsync the checkpoint folder. ``final`` exists as soon
    as rank 0 renamed it, before the folder's fsync and before ``latest``: returning then
    would report a save committed that a power cut could still take back (rank 0's own
    fsync of the folder may not have happened yet; this one makes ``latest`` durable)."""
    ckpt_dir, name = os.path.split(final)
    deadline = time.monotonic() + timeout_s
    while not (os.path.isdir(final) and _latest_is(ckpt_dir, name)):
        failure = _failure(staging, world)
        if failure:
            raise CheckpointError(failure)
        if time.monotonic() > deadline:
            raise CheckpointError(f"{final}: not committed by rank 0 within {timeout_s:.0f} s")
        time.sleep(POLL_S)
    fsync_dir(ckpt_dir)


def _latest_is(ckpt_dir: str, name: str) -> bool:
    try:
        return read_latest(ckpt_dir, CheckpointError) == name
    except CheckpointError:
        return False  # not written yet (or being replaced): asked again at the next poll


def write_latest(ckpt_dir: str, name: str) -> None:
    """Point ``latest`` at generation ``name`` atomically (temp, fsync, rename, fsync dir).

    The temporary file gets a new random name and is created exclusively, never through a
    symlink (``write_text_atomic``): a fixed name such as ``.latest.tmp`` could be a link
    planted there, and writing through it would overwrite (as root: any) file."""
    write_text_atomic(os.path.join(ckpt_dir, LATEST), name + "\n")
