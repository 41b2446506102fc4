"""Where one rank's optimizer state lives on disk, and which tier each array calls home.

Each rank's store is one folder, ``<nvme path>/rank{r}``, holding its arrays by their
layout names (``muon_momentum``, ``adam_exp_avg``, ...) and its manifest (docs/format.md).
Stores written before format version 3 nested them once more (``rank{r}/rank{r}/...``)
and named arrays ``rank{r}/<name>``; a ``homes`` key written for those names
(``"rank*/muon_momentum": "cpu"``, as docs and ``config from-deepspeed`` give it) still
matches, so a config keeps placing the same arrays where it did.
"""

from __future__ import annotations

import fnmatch
import os

from ..layout.manifest import rank_group
from ..store import StoreConfig

STALE_STORE_CHOICES = ("refuse", "discard")


def rank_store_config(cfg: StoreConfig, rank: int) -> StoreConfig:
    """``cfg`` with each NVMe path replaced by rank ``rank``'s folder in it."""
    if not cfg.nvme_paths:
        return cfg
    # exclude_unset: settings left to the device profile stay unset (not pinned as config)
    return StoreConfig.load({**cfg.model_dump(exclude_unset=True), "nvme_paths": [
        os.path.join(p, rank_group(rank)) for p in cfg.nvme_paths]})


def array_home(cfg: StoreConfig, name: str, rank: int) -> str:
    """The home tier of rank ``rank``'s array ``name`` by ``cfg.homes``: an exact key for
    ``name`` or ``rank{r}/name`` first, then the first pattern matching either, else
    ``default_home``."""
    names = (name, f"{rank_group(rank)}/{name}")
    for n in names:
        if n in cfg.homes:
            return cfg.homes[n]
    for pattern, tier in cfg.homes.items():
        if any(fnmatch.fnmatchcase(n, pattern) for n in names):
            return tier
    return cfg.default_home


def stale_store_message(where: str, what: str) -> str:
    """The refusal of a store folder an earlier run left state in (without the opt-in)."""
    return (f"{where} holds optimizer state from an earlier run ({what}); a store is no "
            f"checkpoint, and its bytes are never taken as the state of a new run. To resume "
            f"that run in this directory, build ZeroMuon(..., stale_store=\"discard\") (the "
            f"old arrays are removed) and then load_checkpoint(ckpt_dir, model, optimizer); "
            f"to start a new run, give the store an empty directory")
