"""The stores of every rank of one run, read as one ``TensorSource``.

ZeroMuon at world size W > 1 gives each rank its own store folder under the directory
named in ``nvme_paths`` (``rank0`` ... ``rank{W-1}``, ``optim.store_dir.rank_store_config``).
Each folder holds the whole tensor table (global shapes) but only its own rank's rows (or
box) of every state: no single folder can answer for a whole tensor. ``RankStores`` opens
every folder and serves each read from the ranks that hold its elements, so ``diff`` can
compare a multi-rank store, tensor by tensor, with a checkpoint of its run or with another
store, exactly as it does a one-rank store.

The folders must be one run at one moment: every rank of the world size present, the same
world size, step and tensor table in each, each folder holding the rank its name says.
Anything else is an ``InputError`` that names the folder and what differs (a rank whose
process has not closed its store yet records an older step).
"""

from __future__ import annotations

import os
from typing import Sequence

from ..errors import InputError
from ..formats.ours.reader import OursSource
from ..formats.source import SourceInfo, StateMeta, TensorMeta, TensorSource
from ..io.align import as_byte_view
from ..layout.box_runs import box_runs
from ..layout.manifest import rank_group


class RankStoresError(InputError):
    """The rank folders of a store root are not the stores of one run at one step."""


def open_store_root(root: str, ranks: list[tuple[int, str]], **options) -> TensorSource:
    """The store at ``root`` whose rank folders are ``ranks`` (``formats.detect.
    store_root_ranks``): its only rank's ``OursSource`` when the run had one process,
    else a ``RankStores`` over all of them."""
    first = OursSource(ranks[0][1], "store", **options)
    if first.manifest.world_size in (None, 1) and len(ranks) == 1:
        return first
    sources = [first]
    try:
        _raise_unreadable(root, ranks, options)
        for _, folder in ranks[1:]:
            sources.append(OursSource(folder, "store", **options))
        return RankStores(root, [r for r, _ in ranks], sources)
    except BaseException:
        for s in sources:
            s.close()
        raise


def _raise_unreadable(root: str, ranks: list[tuple[int, str]], options) -> None:
    """A rank folder that is there but was not listed (its manifest cannot be read): open
    it, so that its own error says what is wrong with it."""
    listed = {rank_group(r) for r, _ in ranks}
    for name in sorted(os.listdir(root)):
        folder = os.path.join(root, name)
        if (name not in listed and name.startswith("rank") and name[4:].isdigit()
                and name == rank_group(int(name[4:])) and os.path.isdir(folder)):
            OursSource(folder, "store", **options).close()


def _signature(t: TensorMeta) -> tuple:
    """What two ranks' tensor tables must agree on for one tensor."""
    return (t.name, tuple(t.shape), t.dtype.name, t.optimizer, t.kind,
            tuple((s, m.dtype.name, m.numel) for s, m in t.states.items()))


class RankStores(TensorSource):
    """Rank ``ranks[i]``'s store is ``sources[i]``; together they must be every rank of one
    run at one step (``RankStoresError`` otherwise). Reads fill each element from the first
    rank (in rank order) that holds it: a replicated tensor, which every rank keeps whole,
    is read from rank 0."""

    def __init__(self, root: str, ranks: Sequence[int], sources: Sequence[OursSource]):
        self.root = os.path.abspath(root)
        self.sources = list(sources)
        self._check(list(ranks))
        m0 = self.sources[0].manifest
        self._tensors = self._merged_tensors()
        self._by_name = {t.name: t for t in self._tensors}
        self._held: dict[tuple[str, str], list] = {}
        files = [f for s in self.sources for f in s.info.files]
        self.info = SourceInfo(
            kind="store", path=self.root, format=m0.format, format_version=m0.format_version,
            step=m0.step, world_size=m0.world_size, files=files,
            file_count=sum(s.info.file_count or 0 for s in self.sources))
        self.info.notes.append(f"the stores of {len(self.sources)} ranks (rank0 ... "
                               f"rank{len(self.sources) - 1}), read as one")

    # -- one run at one step -----------------------------------------------------------------
    def _check(self, ranks: list[int]) -> None:
        first = self.sources[0]
        world = first.manifest.world_size
        if not first.manifest.has_tensor_table:
            raise RankStoresError(
                f"{first.group}: this store records no tensor table (the optimizer has not "
                f"written one), so its ranks' rows cannot be put together; diff one rank's "
                f"folder")
        for r, s in zip(ranks, self.sources):
            m = s.manifest
            if m.world_size != world:
                raise RankStoresError(
                    f"{s.group}: world size {m.world_size}, but {first.group} has world size "
                    f"{world}: the rank folders of {self.root} are from different runs")
            if m.ranks != [r]:
                raise RankStoresError(f"{s.group}: the folder of rank {r} holds the store of "
                                      f"rank(s) {m.ranks}")
        # the first few missing (a forged world size may be huge: never counted through)
        held = set(ranks)
        missing = [r for r in range(min(world or 0, len(ranks) + 3)) if r not in held]
        extra = [r for r in ranks if world is None or r >= world]
        if missing or extra:
            more = ", ..." if missing and world - len(ranks) > len(missing) else ""
            what = (f"rank(s) {', '.join(map(str, missing))}{more} missing (no readable "
                    f"{', '.join(f'rank{r}' for r in missing)}{more} folder)" if missing else
                    f"folder(s) {', '.join(f'rank{r}' for r in extra)} beyond it")
            raise RankStoresError(f"{self.root}: a store of world size {world} with {what}; "
                                  f"every rank's store is needed to compare whole tensors")
        steps = {s.manifest.step for s in self.sources}
        if len(steps) > 1:
            shown = ", ".join(f"rank{r} step {s.manifest.step}" for r, s in zip(ranks, self.sources))
            raise RankStoresError(
                f"{self.root}: the ranks' stores are at different steps ({shown}): a run "
                f"still writing, one that stopped part way, or folders of different runs")
        want = {t.name: _signature(t) for t in first.tensors()}
        for r, s in zip(ranks[1:], self.sources[1:]):
            got = {t.name: _signature(t) for t in s.tensors()}
            if got != want:
                name = next(n for n in sorted(set(got) | set(want)) if got.get(n) != want.get(n))
                raise RankStoresError(
                    f"{s.group}: its tensor table differs from rank{ranks[0]}'s (tensor "
                    f"{name!r}): the rank folders of {self.root} are from different runs")

    def _merged_tensors(self) -> list[TensorMeta]:
        """Rank 0's tensor table with every rank's bytes in ``bytes_by_rank``."""
        out = []
        per_rank = [{t.name: t for t in s.tensors()} for s in self.sources]
        for t in self.sources[0].tensors():
            states = {}
            for state, sm in t.states.items():
                held = {}
                for tables in per_rank:
                    held.update(tables[t.name].states[state].bytes_by_rank)
                states[state] = StateMeta(sm.dtype, sm.numel, held)
            out.append(TensorMeta(t.name, t.shape, t.dtype, t.optimizer, states, kind=t.kind,
                                  home=t.home, extra=dict(t.extra)))
        return out

    # -- TensorSource --------------------------------------------------------------------------
    def tensors(self) -> list[TensorMeta]:
        return self._tensors

    def aliases(self) -> dict[str, str]:
        return self.sources[0].aliases()

    def describe(self) -> str:
        m = self.sources[0].manifest
        return (f"live store {self.root} (step {m.step}, world size {m.world_size}, one "
                f"folder per rank)")

    def _runs_held(self, t: TensorMeta, state: str) -> list:
        """``[(source index, first element, end)]``: where each rank's rows or box of
        ``t``'s ``state`` fall in the tensor's flat elements."""
        key = (t.name, state)
        runs = self._held.get(key)
        if runs is None:
            runs = []
            for i, s in enumerate(self.sources):
                for p in s.placements().get(key, []):
                    if p.box is None:
                        runs.append((i, p.dest, p.dest + p.numel))
                    else:
                        runs += [(i, at, at + n) for at, _, n in box_runs(t.shape, *p.box)]
            self._held[key] = runs
        return runs

    def read(self, requests) -> None:
        for req in requests:
            t = self.tensor(req.name)
            state = req.state or t.value_state()
            if state not in t.states:
                raise RankStoresError(f"{self.root}: tensor {req.name!r} has no state {state!r}")
            size = t.states[state].dtype.itemsize
            dest = as_byte_view(req.out)
            todo = [(req.start, req.start + len(dest) // size)]
            for i, a, b in self._runs_held(t, state):
                todo = self._fill(i, t.name, state, a, b, todo, req.start, dest, size)
                if not todo:
                    break
            if todo:  # also elements outside the tensor: no rank holds them
                raise RankStoresError(
                    f"{self.root}: {req.name}/{state}: elements [{todo[0][0]}, {todo[0][1]}) "
                    f"are held by no rank's store (the tensor has {t.states[state].numel})")

    def _fill(self, i: int, name: str, state: str, a: int, b: int, todo: list, lo: int,
              dest: memoryview, size: int) -> list:
        """Read the elements of ``[a, b)`` (held by source ``i``) that ``todo`` still
        wants into ``dest`` (element ``lo`` at byte 0); returns what is left to read."""
        left = []
        for x, y in todo:
            s, e = max(x, a), min(y, b)
            if s >= e:
                left.append((x, y))
                continue
            self.sources[i].read_state(name, state, s, dest[(s - lo) * size:(e - lo) * size])
            if x < s:
                left.append((x, s))
            if e < y:
                left.append((e, y))
        return left

    def close(self) -> None:
        for s in self.sources:
            s.close()
