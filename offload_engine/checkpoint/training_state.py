"""Per-rank training state beside the model and the optimizer: the ``extra`` objects a
caller passes (LR schedulers, samplers, data loaders with ``state_dict`` /
``load_state_dict``, plain dicts) and the RNG states (``rng.py``).

Each rank writes its own group ``rank{r}/training_state`` whose zarr.json attributes hold
``{"training_state": {"extra": {name: state}, "rng": state}}``, every value encoded by
``safe_state`` (strict JSON, no pickle). Its crc32c is in the manifest's
``metadata_checksums`` like every other metadata file, so loading checks it. Ranks differ
where their state does (a sampler's position, each rank's generators).
"""

from __future__ import annotations

import logging
import os

from ..formats.errors import CheckpointError
from ..layout import create_group, read_group
from ..layout.manifest import rank_group
from ..layout.metadata import MetadataError, NodeNotFoundError
from .rng import capture_rng, restore_rng
from .safe_state import _Budget, decode, encode

log = logging.getLogger(__name__)

GROUP = "training_state"
KEY = "training_state"


def group_name(rank: int) -> str:
    """The group of rank ``rank``'s training state inside a generation."""
    return f"{rank_group(rank)}/{GROUP}"


def metadata_key(rank: int) -> str:
    """Its zarr.json as the manifest's ``metadata_checksums`` names it."""
    return f"{group_name(rank)}/zarr.json"


def check_extra(extra) -> dict:
    """``extra`` checked: a dict ``{name: object with state_dict/load_state_dict, or a
    dict}``. TypeError naming the entry otherwise."""
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict {{name: stateful object or dict}}, got "
                        f"{type(extra).__name__}")
    for name, obj in extra.items():
        if not isinstance(name, str):
            raise TypeError(f"extra: names must be strings, got {name!r}")
        if isinstance(obj, dict):
            continue
        if not (callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"extra[{name!r}]: a {type(obj).__name__} has no state_dict() and "
                            "load_state_dict(); pass an object that has them (an LR scheduler, a "
                            "stateful sampler) or a dict, which is restored in place")
    return extra


def capture(extra, rng: bool) -> dict:
    """The encoded state of ``extra`` and (``rng``) of this process's generators, taken
    now (a sampler that moves on after the call is saved as it was at the call).
    TypeError naming the entry for what cannot be stored safely."""
    budget = _Budget()
    doc = {"extra": {}}
    for name, obj in check_extra(extra).items():
        state = obj if isinstance(obj, dict) else obj.state_dict()
        doc["extra"][name] = encode(state, f"extra[{name!r}]", budget)
    if rng:
        doc["rng"] = encode(capture_rng(), "rng", budget)
    return doc


def write(staging: str, rank: int, doc: dict) -> None:
    """Write rank ``rank``'s group (atomically, fsynced with the rank's other files)."""
    create_group(os.path.join(staging, group_name(rank)), {KEY: doc})


def read(gen: str, rank: int, crc32c: int | None) -> dict:
    """Rank ``rank``'s decoded training state from generation ``gen`` (checked against the
    manifest's ``crc32c`` where it records one). CheckpointError naming the file."""
    path = os.path.join(gen, group_name(rank))
    where = os.path.join(path, "zarr.json")
    try:
        doc = read_group(path, crc32c).get(KEY)
    except NodeNotFoundError:
        raise CheckpointError(f"{where}: missing, but the manifest says the generation holds "
                              "training state") from None
    except MetadataError as e:
        raise CheckpointError(str(e)) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("extra"), dict):
        raise CheckpointError(f"{where}: 'training_state' must be an object with 'extra'")
    try:
        out = {"extra": {k: decode(v, f"extra[{k!r}]") for k, v in doc["extra"].items()}}
        if "rng" in doc:
            out["rng"] = decode(doc["rng"], "rng")
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    return out


def restore(state: dict, extra, rng: bool, where: str) -> None:
    """Give each object of ``extra`` its saved state (a dict is cleared and refilled in
    place) and, with ``rng``, set the generators. A name of ``extra`` the checkpoint has
    no state for is a CheckpointError naming it; saved names not asked for are left."""
    saved = state["extra"]
    for name, obj in check_extra(extra).items():
        if name not in saved:
            have = ", ".join(sorted(saved)) or "none"
            raise CheckpointError(f"{where}: no saved state for extra[{name!r}] (saved: {have})")
        if isinstance(obj, dict):
            if not isinstance(saved[name], dict):
                raise CheckpointError(f"{where}: extra[{name!r}] was saved as a "
                                      f"{type(saved[name]).__name__}, not a dict")
            obj.clear()
            obj.update(saved[name])
        else:
            obj.load_state_dict(saved[name])
    if rng:
        if "rng" not in state:
            log.warning("%s: saved without RNG states; the generators are left as they are", where)
            return
        try:
            restore_rng(state["rng"], where)
        except ValueError as e:
            raise CheckpointError(str(e)) from None


def restore_training_state(src, rank: int, extra, rng: bool) -> None:
    """Read this rank's saved training state from the open generation ``src`` (an
    OursSource) and restore ``extra`` and (``rng``) the generators.

    At the saved world size, rank r gets rank r's state. At another world size, rank r
    below the saved world size still gets rank r's; a rank beyond it gets rank 0's extra
    state and keeps its own generators, with a warning (state that differs per rank, such
    as a sampler's position, is then yours to redistribute)."""
    gen = src.group
    info = src.manifest.extra.get("training_state")
    if not isinstance(info, dict):
        if extra:
            raise CheckpointError(f"{gen}: saved without training state (extra objects); "
                                  "this generation holds model and optimizer only")
        log.info("%s: saved without RNG states; the generators are left as they are", gen)
        return
    saved_world = src.manifest.world_size
    from_rank = rank if rank < saved_world else 0
    if from_rank != rank:
        log.warning("%s: saved by %d ranks, this is rank %d: it takes rank 0's extra state and "
                    "keeps its own RNG states", gen, saved_world, rank)
        rng = False
    crcs = src.manifest.metadata_crcs or {}
    if crcs and metadata_key(from_rank) not in crcs:
        raise CheckpointError(f"{gen}: the manifest records no checksum for "
                              f"{metadata_key(from_rank)}")
    state = read(gen, from_rank, crcs.get(metadata_key(from_rank)))
    restore(state, extra, rng, os.path.join(gen, group_name(from_rank), "zarr.json"))
