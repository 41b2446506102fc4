"""Write an imported checkpoint generation, streamed: flat in memory whatever its size or
its number of tensors.

The generation is byte for byte what ``save_checkpoint`` writes for the same data
(docs/format.md): per rank, *packed* arrays (a rank's rows of each tensor back to back, as
``save_checkpoint`` packs parameters; one array per state and dtype; chunks of
``CHUNK_BYTES``, a CRC-32C each) created by the layout's ``FlatArray``, the rank's shard
table and report; then rank 0's manifest, sealed, and the commit (reports removed, fsync,
atomic rename of ``<gen>.partial``, ``latest``) by the checkpoint layer's own
``checkpoint_dir.commit``, so an imported generation is committed as a saved one is.

What differs is where the bytes come from and that nothing is held per tensor: the source's
reads land in the blocks that are written (``import_blocks.py``), and the shard tables and
the tensor table are generated from the plans while they are written
(``layout/group_stream.py``): a mixture-of-experts checkpoint of 100,000 tensors costs no
more memory here than one of 100. Memory: the window (``window_bytes`` of blocks).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Callable

from ..checkpoint.checkpoint_dir import commit, prepare_staging, report_done, report_failed
from ..checkpoint.writer_lock import held
from ..io import AsyncFileIO, round_up
from ..io.page_cache import sync_tree
from ..layout import FlatArray
from ..layout.checkpoint_names import generation_name, staging_path
from ..layout.checksums import SequentialChunkCrc
from ..layout.group_stream import Streamed, write_group_streamed
from ..layout.manifest import (CHECKPOINT_FORMAT, CHECKPOINT_VERSION, CHUNK_BYTES, SHARDS,
                               rank_group, rank_metadata_files, tensor_entry)
from ..layout.metadata_crc import METADATA_KEY, files_crc32c
from ..units import MiB
from .import_blocks import Blocks, write_array
from .import_layout import RankLayout, held_anywhere, rows_per_rank
from .import_plan import TensorPlan

WINDOW_BYTES = 32 * MiB  # bytes read from the source ahead of the disk (the blocks in use)
BLOCK_BYTES = 8 * MiB    # bytes per write

# read(requests): fill every formats.source.ReadRequest (the source's ``read``)
Reader = Callable[[list], None]


@dataclass
class Written:
    """The committed generation and what went into it."""

    path: str
    bytes_written: int


def block_geometry(window_bytes: int) -> tuple[int, int, int]:
    """``(block bytes, blocks, bytes per read call)`` for a window of ``window_bytes``:
    blocks of up to ``BLOCK_BYTES`` (a multiple of 4096, for O_DIRECT), at least two (one
    read while the other is written), and reads of at most the window."""
    window = max(1, window_bytes)
    block = min(BLOCK_BYTES, round_up(window))
    return block, max(2, window // block), min(window, block)


def write_generation(out_dir: str, step: int, world: int, plans: list[TensorPlan], read: Reader,
                     extra_attrs: dict, window_bytes: int = WINDOW_BYTES,
                     chunk_bytes: int = CHUNK_BYTES, progress=None) -> Written:
    """Write and commit generation ``step-<step>`` of ``plans`` for ``world`` ranks under
    ``out_dir``. ``extra_attrs`` join the manifest (a ``Streamed`` member is written as it
    is produced). ``progress(rank, bytes)`` after each rank. A failure leaves no
    ``.partial`` folder behind and nothing committed. The folder's writer lock is held
    throughout: CheckpointLockedError, naming the holder, while a run saves into
    ``out_dir`` (and that run's saves are refused until the import ends)."""
    with held(out_dir):
        return _write_generation(out_dir, step, world, plans, read, extra_attrs,
                                 window_bytes, chunk_bytes, progress)


def _write_generation(out_dir: str, step: int, world: int, plans: list[TensorPlan],
                      read: Reader, extra_attrs: dict, window_bytes: int, chunk_bytes: int,
                      progress) -> Written:
    """``write_generation`` under the folder's writer lock."""
    final = os.path.join(out_dir, generation_name(step))
    staging = staging_path(final)
    problem = prepare_staging(out_dir, final, staging, step)
    if problem is not None:
        raise problem
    block_bytes, count, batch_bytes = block_geometry(window_bytes)
    io = AsyncFileIO(threads=4, queue_depth=8)
    blocks = None
    written, summaries = 0, []
    try:
        blocks = Blocks(block_bytes, count)
        for rank in range(world):
            layout = RankLayout(plans, rank, world)
            write_group_streamed(os.path.join(staging, rank_group(rank)),
                                 {SHARDS: Streamed.object(layout.shard_entries())})
            summary, nbytes = _write_rank(staging, layout, read, io, blocks, batch_bytes,
                                          chunk_bytes)
            report_done(staging, rank, summary)
            summaries.append(summary)
            written += nbytes
            if progress:
                progress(rank, written)
        write_group_streamed(staging, _manifest(plans, step, world, extra_attrs, summaries),
                             sealed=True)
        commit(out_dir, staging, final, None, world)  # the manifest is written (streamed)
    except BaseException as e:
        if blocks is not None:
            blocks.close()
        io.close()
        report_failed(staging, 0, e)
        shutil.rmtree(staging, ignore_errors=True)  # ours, never committed: nothing to keep
        raise
    blocks.close()
    io.close()
    return Written(final, written)


def _write_rank(staging: str, layout: RankLayout, read: Reader, io: AsyncFileIO, blocks: Blocks,
                batch_bytes: int, chunk_bytes: int) -> tuple[dict, int]:
    """Write rank ``layout.rank``'s arrays and fsync them; its report (what
    ``RankWriter.finish`` reports for a save: each array's dtype and size, the chunk
    checksums, the CRC-32C of its metadata files) and the bytes written."""
    arrays = {name: FlatArray.create(os.path.join(staging, name), numel, dtype, io=io,
                                     chunk_bytes=chunk_bytes,
                                     dimension_name=FlatArray.dimension_for(name))
              for name, (dtype, numel) in layout.arrays.items()}
    checksums, nbytes = {}, 0
    for name, arr in arrays.items():
        crcs = SequentialChunkCrc(arr.chunk_bytes, arr.numel * arr.itemsize)
        nbytes += write_array(arr, layout.pieces(name), read, blocks, crcs, batch_bytes)
        checksums[name] = crcs.finish()
    blocks.drain()
    sync_tree(os.path.join(staging, rank_group(layout.rank)))
    return {"checksums": checksums,
            "arrays": {n: {"dtype": a.element.name, "numel": a.numel} for n, a in arrays.items()},
            "metadata_checksums": files_crc32c(
                staging, rank_metadata_files(layout.rank, arrays))}, nbytes


def _tensor_table(plans: list[TensorPlan], world: int):
    """``(name, tensor table entry)`` per tensor, as ``save_checkpoint``'s manifest has
    them once the ranks' Adam steps are merged in."""
    for plan in plans:
        entry = tensor_entry(plan.shape, plan.dtype.name, plan.optimizer,
                             {s.key: s.dtype.name for s in plan.states},
                             rows_per_rank(plan, world), world)
        if plan.kind == "buffer":
            entry["buffer"] = True
        if plan.adam_step is not None and held_anywhere(plan, world):
            entry["adam_step"] = plan.adam_step
        yield plan.name, entry


def _manifest(plans: list[TensorPlan], step: int, world: int, extra: dict,
              summaries: list[dict]) -> dict:
    """Rank 0's attributes, in ``save_checkpoint``'s order: the tensor table (streamed),
    step, world size, buffers, ``extra``, then what the ranks report and the commit flag."""
    def merged(key: str) -> dict:
        return {k: v for s in summaries for k, v in s[key].items()}

    return {"format": CHECKPOINT_FORMAT, "format_version": CHECKPOINT_VERSION, "step": step,
            "world_size": world, "tensors": Streamed.object(_tensor_table(plans, world)),
            "buffers_saved": any(p.kind == "buffer" for p in plans), **extra,
            "arrays": merged("arrays"), "checksums": merged("checksums"),
            METADATA_KEY: merged(METADATA_KEY), "committed": True}
