"""Save a model and its ZeroMuon optimizer as one checkpoint generation (all ranks call it),
while training goes on.

``save_checkpoint_async`` returns as soon as the save is set up: the optimizer state is
copied by the store's snapshot (each bucket as it was at the call, in no memory beyond the
pinned pool: a bucket the next step needs first is copied by that step before it changes
it), and the parameters are written by a background thread that the next
``optimizer.step()`` waits for. ``save_checkpoint`` is the same, waited for.

Each rank writes its own arrays ``rank{r}/<key>`` (rank_writer.py) and its shard table
(where its part of every parameter and state sits: rows, or a box on 2-D meshes) in the
attributes of group ``rank{r}``; when its bytes are fsynced it reports to rank 0 by a
file, and rank 0 writes the tensor table (global shapes, dtypes, optimizer kinds, step,
crc32c of every chunk: docs/format.md, "Manifest") and commits: fsync, atomic rename of ``<gen>.partial`` to ``<gen>``, then
``latest`` (checkpoint_dir.py). The background threads make no collective calls.

Rank 0 holds the folder's writer lock (writer_lock.py) from its first save on: a second
run saving into the folder is refused on every rank before anything is written.
"""

from __future__ import annotations

import os
import time
from functools import partial

import torch
import torch.distributed as dist

from .. import dtypes
from ..io.errors import FileIOError
from ..layout import create_group
from ..layout.checkpoint_names import generation_dir_name, staging_path
from ..layout.manifest import (CHECKPOINT_FORMAT, CHECKPOINT_VERSION, CHUNK_BYTES,
                               array_name, box_shard_entry, rank_group, shard_entry,
                               tensor_entry, tensor_rows, write_shard_table)
from ..layout.metadata_crc import METADATA_KEY, files_crc32c
from ..optim.state_access import (adam_step, has_state, local_param, saved_parts, saved_rows,
                                  state_arrays, state_dtype, state_offsets)
from . import training_state
from .buffers import snapshot_buffers
from .checkpoint_dir import (commit, prepare_staging, report_done, report_failed, wait_for_commit,
                             wait_for_ranks)
from .model_tensors import (frozen_parameters, frozen_rows, local_rows, reshard_fsdp, row_block,
                            tied_aliases)
from .pending import PENDING_ATTR, PendingCheckpoint, finish_previous, guard
from .rank_writer import RankWriter
from .retention import apply_retention, check_keep_last
from ..formats.errors import CheckpointSaveError
from .shared_dir import check_shared, write_marker
from .writer_lock import StagingClaim, hold_for
from .supported import check_optimizer
from ..store.geometry import elems_per_bucket

COMMIT_TIMEOUT_S = 3600.0       # how long rank 0 waits for the others' parts


def _collective() -> tuple[int, int, bool]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), True
    return 0, 1, False


def param_name(info) -> str:
    return info.name or f"param.{info.index}"


def save_checkpoint(ckpt_dir: str, model: torch.nn.Module, optimizer, step: int, *,
                    extra: dict | None = None, tag: str | None = None,
                    keep_last: int | None = None, rng: bool = True,
                    chunk_bytes: int = CHUNK_BYTES) -> str:
    """Write generation ``step-<step>`` (or ``tag``) under ``ckpt_dir`` and wait until it
    is committed; collective over all ranks. Returns the committed directory.

    Saved: the optimizer's parameters and state; ``model``'s parameters the optimizer does
    not hold (frozen), its tied names and persistent buffers; each rank's ``extra`` objects
    (``{name: object with state_dict/load_state_dict, or a dict}``: LR schedulers,
    samplers, your own dict; strict JSON, no pickle) and, with ``rng``, each rank's RNG
    states (Python, numpy, torch CPU and CUDA). ``keep_last``: then remove all but the
    newest ``keep_last`` generations, never the one ``latest`` names. See
    docs/checkpoint.md."""
    return save_checkpoint_async(ckpt_dir, model, optimizer, step, extra=extra, tag=tag,
                                 keep_last=keep_last, rng=rng, chunk_bytes=chunk_bytes).wait()


@torch.no_grad()
def save_checkpoint_async(ckpt_dir: str, model: torch.nn.Module, optimizer, step: int, *,
                          extra: dict | None = None, tag: str | None = None,
                          keep_last: int | None = None, rng: bool = True,
                          chunk_bytes: int = CHUNK_BYTES,
                          commit_timeout_s: float = COMMIT_TIMEOUT_S) -> PendingCheckpoint:
    """Start writing generation ``step-<step>`` and return at once; collective over all
    ranks (call it between steps, on every rank). ``.wait()`` on the result blocks until
    the generation is committed and raises what went wrong.

    Until then: the next ``optimizer.step()`` first waits for the parameters to be written
    (a pre-hook), and parameters must not be changed other than by that step; a bucket of
    state the step needs before the snapshot copied it is copied by the step (one bucket
    write). A second save waits for the first. The thread is not a daemon: a script that
    ends right after saving still commits. ``extra``, the RNG states and the buffers are
    taken at the call; the arguments are ``save_checkpoint``'s. Retention (``keep_last``)
    runs on rank 0 after the commit, before ``wait()`` returns there.
    """
    opt = check_optimizer(optimizer, "save_checkpoint")
    keep_last = check_keep_last(keep_last)
    training_state.check_extra(extra)
    finish_previous(opt)
    t0 = time.perf_counter()
    rank, world, coll = _collective()
    name = generation_dir_name(step, tag)
    final = os.path.join(ckpt_dir, name)
    staging = staging_path(final)
    problem = token = claim = None
    if rank == 0:
        lock, problem = _writer_lock(ckpt_dir, opt)
        if problem is None:
            problem = prepare_staging(ckpt_dir, final, staging, step)
        if problem is None:
            claim, problem = _claim(lock, staging)
        if problem is None and coll:
            try:
                token = write_marker(staging)
            except OSError as e:
                problem = e
    if coll:  # every rank learns whether rank 0 could start, instead of waiting in a barrier
        shared = [problem, token]
        dist.broadcast_object_list(shared, src=0)
        problem, token = shared
    if problem is not None:
        raise CheckpointSaveError.wrap(problem, final, 0)  # rank 0 prepares the generation's folder
    try:
        if coll:  # a folder other nodes do not see would be a save that never commits
            check_shared(ckpt_dir, staging, token, rank, world)
    except BaseException:
        _ended(claim)
        raise

    pending = PendingCheckpoint(final, step)
    buffers = snapshot_buffers(model) if rank == 0 and model is not None else {}
    try:
        reshard_fsdp(model)  # an evaluation left FSDP2's root unsharded: save its shards
        frozen = [(n, t, frozen_rows(t, n, rank, world)) for n, t in frozen_parameters(model, opt)]
        state_doc = training_state.capture(extra, rng)  # now: a sampler moves on after the call
        plan = _plan(opt, rank, chunk_bytes, buffers, frozen)
        create_group(os.path.join(staging, rank_group(rank)), {})
        write_shard_table(staging, rank, plan["shards"])
        training_state.write(staging, rank, state_doc)
        adam_steps = {param_name(i): adam_step(opt, i) for i in plan["infos"]}
        attrs = _manifest(opt, step, world, buffers, frozen, model, state_doc) if rank == 0 else None
        writer = RankWriter(staging, rank, plan["param_arrays"], plan["params"],
                            plan["state_arrays"], chunk_bytes)
        try:
            snap = opt.store.snapshot(writer.sink, arrays=list(plan["state_arrays"])) \
                if plan["state_arrays"] else None
        except BaseException:
            writer.close()
            raise
    except BaseException as e:
        report_failed(staging, rank, e)  # so that rank 0 does not wait for this rank
        _ended(claim)
        raise CheckpointSaveError.wrap(e, final, rank)

    def body() -> None:
        try:
            _write_rank(pending, writer, snap, staging, rank, adam_steps, t0)
            if rank == 0:
                _commit_as_rank0(ckpt_dir, staging, final, attrs, world, commit_timeout_s, claim)
                if keep_last is not None:
                    apply_retention(ckpt_dir, keep_last, name, claim.lock)
            else:
                wait_for_commit(staging, final, world, commit_timeout_s)
        except BaseException as e:  # an I/O error says which generation and rank
            raise CheckpointSaveError.wrap(e, final, rank)
        finally:
            _ended(claim)

    # the snapshot runs: from here on, Ctrl-C must not leave the save with nobody to finish
    # it. No call before these two statements: whoever waits for the save next runs the
    # body if its thread never starts (pending.py)
    pending._body = body
    setattr(opt, PENDING_ATTR, pending)
    try:
        guard(opt, pending)
    finally:
        pending._run()
    pending.stats["call_s"] = time.perf_counter() - t0
    return pending


def _writer_lock(ckpt_dir: str, opt):
    """Rank 0: the folder's writer lock, held by this process for as long as ``opt``
    lives (writer_lock.py), or the error to broadcast (another run holds it)."""
    try:
        return hold_for(ckpt_dir, opt), None
    except Exception as e:  # every rank raises it, not only rank 0
        return None, e


def _claim(lock, staging: str):
    """Rank 0: ``(StagingClaim, None)`` on the staging folder just made, or ``(None,
    error)``."""
    try:
        return StagingClaim(lock, staging), None
    except OSError as e:
        return None, FileIOError(e.errno, "open", staging)


def _ended(claim) -> None:
    """Rank 0: the save is no longer in flight (committed or failed)."""
    if claim is not None:
        claim.release()


def _write_rank(pending: PendingCheckpoint, writer: RankWriter, snap, staging: str, rank: int,
                adam_steps: dict, t0: float) -> None:
    """Background: this rank's parameters, then its state (the snapshot), fsync, report."""
    try:
        t = time.perf_counter()
        writer.write_params()
        pending.params_written.set()
        pending.stats["params_s"] = time.perf_counter() - t
        if snap is not None:
            snap.wait()
            pending.stats["inline_copies"] = snap.copied_inline
            pending.stats["state_buckets"] = snap.total
        summary = writer.finish()
        summary[METADATA_KEY].update(files_crc32c(staging, [training_state.metadata_key(rank)]))
        pending.stats["bytes"] = writer.bytes_written
        summary["adam_steps"] = {k: v for k, v in adam_steps.items() if v is not None}
        report_done(staging, rank, summary)
        pending.stats["written_s"] = time.perf_counter() - t0
    except BaseException as e:
        if snap is not None:
            try:  # the store's copy must end before its sink's files close
                snap.wait()
            except BaseException:
                pass
        writer.close()
        report_failed(staging, rank, e)
        raise


def _commit_as_rank0(ckpt_dir: str, staging: str, final: str, attrs: dict, world: int,
                     timeout_s: float, claim: StagingClaim | None = None) -> None:
    """Background, rank 0: merge every rank's report into the manifest and commit;
    ``claim``: checked first to still hold the folder this save made (one someone replaced
    meanwhile holds what this save never wrote)."""
    try:
        summaries = wait_for_ranks(staging, world, timeout_s)
        if claim is not None:
            claim.check()
        attrs["arrays"] = {k: v for g in summaries for k, v in g["arrays"].items()}
        attrs["checksums"] = {k: v for g in summaries for k, v in g["checksums"].items()}
        attrs[METADATA_KEY] = {k: v for g in summaries for k, v in g[METADATA_KEY].items()}
        steps = {k: v for g in reversed(summaries) for k, v in g["adam_steps"].items()}  # rank 0's win
        for pname, v in steps.items():
            attrs["tensors"][pname]["adam_step"] = v
        attrs["committed"] = True
        commit(ckpt_dir, staging, final, attrs, world)
    except BaseException as e:
        report_failed(staging, 0, e)
        raise


def _plan(opt, rank: int, chunk_bytes: int, buffers: dict[str, torch.Tensor],
          frozen: list = ()) -> dict:
    """Which arrays this rank writes and where each parameter's part lands in them.

    State arrays copy the store's arrays whole (so the snapshot's buckets map to chunks);
    a parameter's state sits where the store keeps it. Parameter parts are packed, and so
    are ``buffers`` (rank 0's copies) and the ``frozen`` parameters (``[(name, tensor,
    rows of each rank)]``: this rank's rows of a DTensor). Each element is saved once
    (``saved_parts``): a replicated (non-DTensor) parameter by rank 0, a box held by
    several ranks (HSDP replicas) by the first of them; a run with boxes copies only the
    state arrays that hold something this rank saves, so an HSDP replica above the first
    writes nothing."""
    world = _collective()[1]
    parts = {i.index: saved_parts(i, world) for i in opt.infos}
    infos = [i for i in opt.infos if parts[i.index][rank] is not None]
    bucket_bytes = opt.store.config.bucket_bytes
    names = {}         # layout array -> (its name here, store array, dtype, numel)
    for layout_name, (store_name, key, dtype, numel) in state_arrays(opt).items():
        names[layout_name] = (array_name(rank, key, dtype), store_name, dtype, numel)
    holding = set()    # layout arrays holding state this rank saves
    param_arrays: dict[str, tuple[torch.dtype, int]] = {}
    params, shards = [], {}

    def pack(label: str, source, kind: str, dtype: torch.dtype, n: int) -> tuple[str, int]:
        """Append ``n`` elements to the packed array of ``kind`` and ``dtype``."""
        arr = array_name(rank, kind, dtype)
        used = param_arrays.get(arr, (dtype, 0))[1]
        param_arrays[arr] = (dtype, used + n)
        params.append((label, source, arr, used))
        return arr, used

    for info in infos:
        box = parts[info.index][rank]
        n = box.numel
        states = {"param": pack(param_name(info), partial(local_param, info), "param", info.dtype, n)}
        if has_state(opt, info):
            for key, (layout_name, offset, numel) in state_offsets(opt, info).items():
                if numel != n:
                    raise AssertionError(f"{param_name(info)}: {numel} elements of {key} in the "
                                         f"store, {n} in the parameter")
                states[key] = (names[layout_name][0], offset)
                holding.add(layout_name)
        rows = saved_rows(info, parts[info.index])
        if rows is not None:
            shards[param_name(info)] = shard_entry(sum(rows[:rank]), rows[rank], n, states)
        else:
            shards[param_name(info)] = box_shard_entry(box.lo, box.shape, states)
    for name, t, held in frozen:
        if not row_block(t, name).distributed and rank != 0:
            continue
        local = local_rows(t)
        where = pack(name, partial(local_rows, t), "param", t.dtype, local.numel())
        shards[name] = shard_entry(sum(held[:rank]), held[rank], local.numel(), {"param": where})
    for name, buf in buffers.items():
        where = pack(f"buffer {name}", partial(buf.reshape, -1), "buffer", buf.dtype, buf.numel())
        shards[name] = shard_entry(0, tensor_rows(buf.shape), buf.numel(), {"param": where})
    copies = {}        # store array -> (name here, dtype, numel, chunk bytes = its bucket)
    every_array = all(i.boxes is None for i in opt.infos)   # as 1-D runs always did
    for layout_name, (here, store_name, dtype, numel) in names.items():
        if layout_name in holding or every_array:
            copies[store_name] = (here, dtype, numel,
                                  elems_per_bucket(bucket_bytes, dtype) * dtype.itemsize)
    return {"infos": infos, "param_arrays": param_arrays, "params": params, "shards": shards,
            "state_arrays": copies}


def _manifest(opt, step: int, world: int, buffers: dict[str, torch.Tensor], frozen: list = (),
              model=None, state_doc: dict | None = None) -> dict:
    """Rank 0: the generation's attributes but for what the ranks report (arrays, checksums,
    AdamW steps): the tensor table (buffers, which rank 0 holds whole, parameters, frozen
    parameters), step, world size, parameter groups, tied names, what training state each
    rank wrote."""
    tensors = {}
    for name, buf in buffers.items():
        dtype = dtypes.dtype(buf.dtype).name
        tensors[name] = tensor_entry(buf.shape, dtype, None, {"param": dtype},
                                     [tensor_rows(buf.shape)] + [0] * (world - 1), world)
        tensors[name]["buffer"] = True
    for info in opt.infos:
        parts = saved_parts(info, world)
        rows = saved_rows(info, parts)
        boxes = None if rows is not None else [None if b is None else (b.lo, b.shape)
                                               for b in parts]
        tensors[param_name(info)] = tensor_entry(
            info.shape, dtypes.dtype(info.dtype).name, info.kind,
            {k: dtypes.dtype(dt).name for k, dt in saved_states(opt, info).items()},
            rows or [], world, boxes)
    for name, t, held in frozen:
        dtype = dtypes.dtype(t.dtype).name
        tensors[name] = tensor_entry(t.shape, dtype, None, {"param": dtype}, held, world)
        tensors[name]["frozen"] = True
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()
               if k not in ("params", "param_names") and _jsonable(v)}
              for g in opt.param_groups]
    attrs = {"format": CHECKPOINT_FORMAT, "format_version": CHECKPOINT_VERSION, "step": step,
             "world_size": world, "tensors": tensors, "param_groups": groups,
             "buffers_saved": True, "frozen_saved": model is not None}
    saved_name = {id(i.param): param_name(i) for i in opt.infos}
    saved_name.update({id(t): name for name, t, _ in frozen})
    aliases = {a: o for a, o in tied_aliases(model, saved_name).items() if a not in tensors}
    if aliases:
        attrs["aliases"] = aliases
    if state_doc is not None:
        attrs["training_state"] = {"extra": sorted(state_doc["extra"]), "rng": "rng" in state_doc}
    return attrs


def saved_states(opt, info) -> dict[str, torch.dtype]:
    """``{key: dtype}`` of what is saved for parameter ``info``: ``param`` and, once it has
    optimizer state, every state key (``master_param`` is float32, the others the state
    dtype of its bundle)."""
    out = {"param": info.dtype}
    if has_state(opt, info):
        for key in state_offsets(opt, info):
            out[key] = state_dtype(opt, info, key)
    return out


def _jsonable(v) -> bool:
    return isinstance(v, (int, float, str, bool, type(None))) or (
        isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v))
