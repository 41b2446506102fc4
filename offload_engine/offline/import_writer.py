"""Write an imported checkpoint generation with the checkpoint layer's own writer.

Nothing here knows the on-disk format: each target rank's arrays are written by
``checkpoint.rank_writer.RankWriter`` (page-aligned staging blocks, O_DIRECT, crc32c of
every chunk), its shard table by ``layout.manifest``, and rank 0's manifest and the commit
(fsync, atomic rename of ``<gen>.partial``, ``latest``) by ``checkpoint.save``'s commit, so
an imported generation is written exactly as ``save_checkpoint`` writes one.

What differs is where the bytes come from: every array is a *packed* array (as
``save_checkpoint`` packs parameters): a rank's rows of each tensor back to back, one array
per state and dtype, filled by reading windows of at most ``window_bytes`` from the source.
Memory: a window at a time (two with its read-ahead), plus the writer's 32 MiB of staging.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import shutil
from dataclasses import dataclass
from typing import Callable

from ..checkpoint.checkpoint_dir import prepare_staging, report_done, report_failed
from ..checkpoint.rank_writer import RankWriter
from ..checkpoint.save import CHUNK_BYTES, COMMIT_TIMEOUT_S, array_name, commit_generation
from ..checkpoint.writer_lock import held
from ..layout import create_group
from ..layout.checkpoint_names import generation_name, staging_path
from ..layout.manifest import (CHECKPOINT_FORMAT, CHECKPOINT_VERSION, fsdp_rows, rank_group,
                               shard_entry, tensor_entry, tensor_rows, write_shard_table)
from ..units import MiB
from .import_plan import TensorPlan

WINDOW_BYTES = 32 * MiB  # bytes read from the source per window

# read(pieces) -> a 1-D CPU torch tensor of one array's dtype holding, back to back, each
# piece: (tensor plan, state key, first element, elements)
Reader = Callable[[list], object]


@dataclass
class Written:
    """The committed generation and what went into it."""

    path: str
    bytes_written: int


def rows_per_rank(plan: TensorPlan, world: int) -> tuple[int, ...]:
    """Rows each target rank holds: FSDP2 ``Shard(0)`` for parameters (what ZeroMuon over
    an FSDP2 model keeps), all on rank 0 for buffers (as ``save_checkpoint`` saves them)."""
    rows = tensor_rows(plan.shape)
    if plan.kind == "buffer":
        return (rows,) + (0,) * (world - 1)
    return fsdp_rows(rows, world)


def _row_numel(shape) -> int:
    return math.prod(shape[1:]) if len(shape) > 1 else 1


class _ReadAhead:
    """Reads the windows of one rank in the order the writer asks for them, one ahead on
    a helper thread, so that reading the source overlaps writing the target."""

    def __init__(self, jobs: list, read: Reader):
        self._jobs = jobs
        self._read = read
        self._next = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="oe-import-read")
        self._pending = self._submit(0)

    def _submit(self, i: int):
        return self._pool.submit(self._read, self._jobs[i]) if i < len(self._jobs) else None

    def source(self, index: int):
        """The callable the writer calls for job ``index`` (called in job order)."""
        def get():
            if index != self._next:
                raise AssertionError(f"import window {index} asked for before window {self._next}")
            data = self._pending.result()
            self._next += 1
            self._pending = self._submit(self._next)
            return data
        return get

    def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
        self._pool.shutdown(wait=True)


def _rank_layout(plans: list[TensorPlan], rank: int, world: int, window_bytes: int):
    """This rank's packed arrays, its shard table, and the read jobs in write order: a job
    is ``(array, first element, pieces)``, the pieces (tensor plan, state key, first
    element, elements) that fill the next at most ``window_bytes`` of the array. Small
    tensors share a job (a mixture-of-experts model's 100,000 experts are a few hundred
    jobs, not a job, a read and a buffer each)."""
    arrays: dict[str, tuple] = {}   # array name -> (dtype, numel)
    shards = {}
    windows: dict[str, list] = {}   # array name -> its jobs: [first element, pieces, elements]
    for plan in plans:
        held = rows_per_rank(plan, world)
        rows = held[rank]
        if rows == 0:
            continue
        row_start = sum(held[:rank])
        per_row = _row_numel(plan.shape)
        first, numel = row_start * per_row, rows * per_row
        where = {}
        for state in plan.states:
            kind = "buffer" if plan.kind == "buffer" else state.key
            name = array_name(rank, kind, state.dtype.torch)
            dtype, used = arrays.get(name, (state.dtype.torch, 0))
            arrays[name] = (dtype, used + numel)
            where[state.key] = (name, used)
            step = max(1, window_bytes // state.dtype.itemsize)
            jobs = windows.setdefault(name, [])
            for lo in range(0, numel, step):
                n = min(step, numel - lo)
                last = jobs[-1] if jobs else None
                if last is not None and last[0] + last[2] == used + lo and last[2] + n <= step:
                    last[1].append((plan, state.key, first + lo, n))
                    last[2] += n
                else:
                    jobs.append([used + lo, [(plan, state.key, first + lo, n)], n])
        shards[plan.name] = shard_entry(row_start, rows, numel, where)
    # the order RankWriter.write_params writes in: by array, then element
    jobs = [(name, at, pieces) for name in sorted(windows) for at, pieces, _ in windows[name]]
    return arrays, shards, jobs


def write_generation(out_dir: str, step: int, world: int, plans: list[TensorPlan], read: Reader,
                     extra_attrs: dict, window_bytes: int = WINDOW_BYTES,
                     chunk_bytes: int = CHUNK_BYTES, progress=None) -> Written:
    """Write and commit generation ``step-<step>`` of ``plans`` for ``world`` ranks under
    ``out_dir``. ``extra_attrs`` join the manifest. ``progress(rank, bytes)`` after each
    rank. A failure leaves no ``.partial`` folder behind and nothing committed. The
    folder's writer lock is held throughout: CheckpointLockedError, naming the holder, while
    a run saves into ``out_dir`` (and that run's saves are refused until the import ends)."""
    with held(out_dir):
        return _write_generation(out_dir, step, world, plans, read, extra_attrs,
                                 window_bytes, chunk_bytes, progress)


def _write_generation(out_dir: str, step: int, world: int, plans: list[TensorPlan],
                      read: Reader, extra_attrs: dict, window_bytes: int, chunk_bytes: int,
                      progress) -> Written:
    """``write_generation`` under the folder's writer lock."""
    name = generation_name(step)
    final = os.path.join(out_dir, name)
    staging = staging_path(final)
    problem = prepare_staging(out_dir, final, staging, step)
    if problem is not None:
        raise problem
    written = 0
    try:
        for rank in range(world):
            arrays, shards, jobs = _rank_layout(plans, rank, world, window_bytes)
            create_group(os.path.join(staging, rank_group(rank)), {})
            write_shard_table(staging, rank, shards)
            adam_steps = {p.name: p.adam_step for p in plans
                          if p.adam_step is not None and shards.get(p.name)}
            del shards  # written: not held while the arrays are
            ahead = _ReadAhead([pieces for _, _, pieces in jobs], read)
            try:
                params = [(_job_label(pieces), ahead.source(i), name, at)
                          for i, (name, at, pieces) in enumerate(jobs)]
                writer = RankWriter(staging, rank, arrays, params, {}, chunk_bytes)
                try:
                    writer.write_params()
                    summary = writer.finish()
                except BaseException:
                    writer.close()
                    raise
            finally:
                ahead.close()
            summary["adam_steps"] = adam_steps
            report_done(staging, rank, summary)
            written += writer.bytes_written
            if progress:
                progress(rank, written)
        commit_generation(out_dir, staging, final, _manifest(plans, step, world, extra_attrs),
                          world, COMMIT_TIMEOUT_S)
    except BaseException as e:
        report_failed(staging, 0, e)
        shutil.rmtree(staging, ignore_errors=True)  # ours, never committed: nothing to keep
        raise
    return Written(final, written)


def _job_label(pieces: list) -> str:
    """The tensors a job fills, for messages: the first and, for several, the last."""
    first = f"{pieces[0][0].name}/{pieces[0][1]}"
    return first if len(pieces) == 1 else f"{first} .. {pieces[-1][0].name}/{pieces[-1][1]}"


def _manifest(plans: list[TensorPlan], step: int, world: int, extra: dict) -> dict:
    """Rank 0's attributes but for what the ranks report (arrays, checksums, steps), as
    ``save_checkpoint`` builds them: the tensor table, then step, world size, buffers."""
    tensors = {}
    for plan in plans:
        entry = tensor_entry(plan.shape, plan.dtype.name, plan.optimizer,
                             {s.key: s.dtype.name for s in plan.states},
                             rows_per_rank(plan, world), world)
        if plan.kind == "buffer":
            entry["buffer"] = True
        tensors[plan.name] = entry
    return {"format": CHECKPOINT_FORMAT, "format_version": CHECKPOINT_VERSION, "step": step,
            "world_size": world, "tensors": tensors,
            "buffers_saved": any(p.kind == "buffer" for p in plans), **extra}
