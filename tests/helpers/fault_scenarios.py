"""Scenarios for the fault-injection tests (tests/io/test_fault_injection.py).

A scenario is a list of operations on the store or on a ZeroMuon optimizer and its
checkpoints. ``run_ops`` runs them on a thread, with a ``FaultPlan`` armed
(offload_engine/io/faults.py), under a deadline: a hang is reported as a failure, not a
stuck test. The first error ends the fault (the plan is disarmed for good, as a disk that
got its room back) and, for an operation that may be repeated, the operation runs once
more and must then succeed. Each scenario then checks, with no fault armed, what a user
relies on: nothing written was lost, and every committed checkpoint loads bit-exact.
"""

from __future__ import annotations

import errno
import faulthandler
import os
import re
import sys
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from offload_engine.io import faults
from offload_engine.io.faults import FaultPlan
from offload_engine.store.lock import LEGACY_LOCK_NAME as LOCK

B = 4096              # bucket bytes: small, so a small pool evicts and writes back
DEADLINE_S = 60.0     # what a scenario may take before it counts as hung (seconds)
ERRNOS = (errno.ENOSPC, errno.EIO)


@dataclass
class Op:
    name: str
    run: object           # callable()
    armed: bool = True    # the plan is armed while it runs
    retry: bool = True    # after its error (fault cleared), it runs once more


@dataclass
class Outcome:
    errors: list = field(default_factory=list)   # (op name, exception) surfaced
    failure: BaseException | None = None         # an op that failed again with no fault
    hung: bool = False


def run_ops(ops: list[Op], plan: FaultPlan, deadline_s: float = DEADLINE_S) -> Outcome:
    """Run ``ops`` in order on a thread with ``plan`` armed for the armed ones."""
    out = Outcome()

    def body():
        live = True  # the plan is armed for armed ops until the first error
        try:
            for op in ops:
                if not op.armed:  # a check between armed ops: its errors are failures
                    op.run()
                    continue
                if live:
                    faults.arm(plan)
                try:
                    op.run()
                except Exception as e:
                    faults.disarm()
                    live = False
                    out.errors.append((op.name, e))
                    if op.retry:
                        op.run()
                finally:
                    faults.disarm()
        except BaseException as e:
            out.failure = e

    t = threading.Thread(target=body, name="fault-scenario", daemon=True)
    t.start()
    t.join(deadline_s)
    faults.disarm()
    if t.is_alive():
        out.hung = True
        faulthandler.dump_traceback(file=sys.stderr)
    return out


def path_label(root: str):
    """A FaultPlan label: which folder under ``root`` and what kind of file, e.g.
    ``ck:chunk``, ``state:zarr.json``, ``ck:latest``, ``s1:dir`` (numbers and the random
    part of temporary names dropped), so that the sweep aims at each kind of file that a
    shared function (the I/O threads, the atomic writer) handles."""
    root = os.path.abspath(root)

    def label(path: str) -> str:
        rel = os.path.relpath(path, root)
        top = re.sub(r"\d+", "#", rel.split(os.sep)[0])
        name = os.path.basename(path)
        if name.isdigit() and os.path.basename(os.path.dirname(path)) == "c":
            what = "chunk"
        elif name.startswith(".") and name.endswith(".tmp"):   # .<final name>.<hex>.tmp
            what = "tmp " + name[1:].rsplit(".", 2)[0]
        elif name in ("zarr.json", "latest", ".done.json", ".failed.json", LOCK):
            what = name
        else:
            what = "dir"
        return f"{top}:{what}"

    return label


def check_error_names_the_file(err: BaseException, root: str, code: int, where: str) -> None:
    """An error a fault caused must say which file (a path under the test's ``root``) and
    which errno. Writes raise an OSError carrying the errno; a zarr.json that cannot be
    read is a MetadataError (a ValueError) whose message carries it."""
    text = str(err)
    assert root in text, f"{where}: the error names no file under {root}: {text}"
    assert errno.errorcode[code] in text or os.strerror(code) in text, \
        f"{where}: the error does not say {errno.errorcode[code]}: {text}"
    if isinstance(err, OSError):
        assert err.errno == code, f"{where}: errno {err.errno}, injected {code}: {text}"
    else:
        from offload_engine.layout import MetadataError
        assert isinstance(err, MetadataError) and "cannot read" in text, \
            f"{where}: {type(err).__name__} is not an OSError: {text}"


# -- the store alone -------------------------------------------------------------------------------
ARRAYS = {"m": 10, "v": 6}   # array -> buckets (float32, B bytes each)


class StoreScenario:
    """A store striped over two directories with a pool of four buckets: open, register
    two arrays, three steps over every bucket (evictions and write-backs), a manifest
    update, ``flush(sync=True)``, close. ``shadow`` is what every array must hold."""

    def __init__(self, root: str):
        self.root = root
        self.config = dict(nvme_paths=[os.path.join(root, "s0"), os.path.join(root, "s1")],
                           cpu_budget=4 * B, bucket_bytes=B, prefetch_depth=1, io_threads=2,
                           queue_depth=2, acquire_timeout_s=20)
        self.shadow = {n: np.zeros(k * B // 4, np.float32) for n, k in ARRAYS.items()}
        self.store = None
        self.steps_done = 0

    def ops(self) -> list[Op]:
        return [Op("open", self.open), Op("register", self.register), Op("steps", self.steps),
                Op("manifest", self.manifest), Op("flush", self.flush),
                Op("close", self.close, retry=False)]

    def open(self) -> None:
        from offload_engine.store import TieredStore
        if self.store is None:
            self.store = TieredStore(self.config)

    def register(self) -> None:
        for name, buckets in ARRAYS.items():
            if name not in self.store.arrays():
                self.store.register(name, torch.float32, buckets * B // 4)

    def steps(self) -> None:
        """Three steps; each changes every bucket, and the shadow follows as it goes (so a
        step repeated after an error stays in step with it)."""
        s = self.store
        while self.steps_done < 3:
            order = s.begin_step() or [(n, i) for n, k in ARRAYS.items() for i in range(k)]
            for name, i in order:
                h = s.acquire(name, i)
                base = 1 + i + 100 * list(ARRAYS).index(name) + self.steps_done
                h.tensor.mul_(0.5).add_(torch.arange(h.tensor.numel(), dtype=torch.float32)
                                        + base)
                s.release(h, dirty=True)
                view = self.shadow[name][h.start:h.stop]
                view *= np.float32(0.5)
                view += np.arange(view.size, dtype=np.float32) + np.float32(base)
            self.steps_done += 1

    def manifest(self) -> None:
        self.store.update_manifest({"step": self.steps_done})

    def flush(self) -> None:
        self.store.flush(sync=True)

    def close(self) -> None:
        store, self.store = self.store, None
        if store is not None:
            store.close()

    # -- checks, with no fault armed ----------------------------------------------------------
    def check_recovered(self, outcome: Outcome) -> None:
        """Nothing held, nothing lost: the live store (if still open) holds the shadow, and
        so does the store reopened from disk after a flush and close."""
        s = self.store
        if s is not None:  # the scenario stopped before its close (or close is still to come)
            held = [b.key for b in s._resident if b.refs > b.keeps]
            assert not held, f"buckets still lent after the error: {held}"
            self.compare(s, "the live store")
            s.close()
            self.store = None
        closed_with_error = any(name == "close" for name, _ in outcome.errors)
        from offload_engine.store import TieredStore
        with TieredStore(self.config) as again:  # the write lock was released
            for name, buckets in ARRAYS.items():
                again.register(name, torch.float32, buckets * B // 4)
            if not closed_with_error:  # a close that failed may lose what it could not write
                self.compare(again, "the store reopened from disk")

    def compare(self, store, what: str) -> None:
        for name in ARRAYS:
            for i, (lo, hi) in enumerate(store.bucket_ranges(name)):
                h = store.acquire(name, i)
                got = h.tensor.numpy().copy()
                store.release(h)
                want = self.shadow[name][lo:hi]
                assert np.array_equal(got, want), f"{what}: array {name} bucket {i} differs"


# -- ZeroMuon and its checkpoints ------------------------------------------------------------------
MUON = dict(lr=0.02, weight_decay=0.1)
ADAMW = dict(lr=3e-3, weight_decay=0.01)


def optimizer_store(path: str) -> dict:
    return {"nvme_paths": [path], "bucket_bytes": B, "cpu_budget": 4 * B, "prefetch_depth": 1,
            "io_threads": 2, "acquire_timeout_s": 20}


def make_optimizer(path: str, seed: int = 5, mesh=None):
    from offload_engine.optim import ZeroMuon
    from helpers.zero_muon_harness import MIXED_SHAPES, make_pair
    model, _ = make_pair(MIXED_SHAPES, mesh, seed=seed)
    opt = ZeroMuon(model.named_parameters(), **MUON, adamw=ADAMW, store=optimizer_store(path))
    return model, opt


def set_grads(model, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        grad = torch.randn(local.shape, generator=g).to(p.dtype)
        if hasattr(p, "to_local"):
            from torch.distributed.tensor import DTensor
            p.grad = DTensor.from_local(grad, p.device_mesh, p.placements, run_check=False,
                                        shape=p.shape, stride=p.stride())
        else:
            p.grad = grad


def capture(model, opt) -> dict:
    """Parameters and every state tensor, cloned (this rank's rows)."""
    params = {n: _local(p).detach().clone() for n, p in model.named_parameters()}
    state = {i: {k: _local(v).clone() for k, v in entry.items()}
             for i, entry in opt.state_dict()["state"].items()}
    return {"params": params, "state": state}


def assert_same(model, opt, want: dict, where: str) -> None:
    got = capture(model, opt)
    for n, t in want["params"].items():
        assert torch.equal(got["params"][n], t), f"{where}: parameter {n} differs"
    assert set(got["state"]) == set(want["state"]), f"{where}: state entries differ"
    for i, entry in want["state"].items():
        for k, t in entry.items():
            assert torch.equal(got["state"][i][k], t), f"{where}: state {k} of {i} differs"


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def store_bytes(store) -> dict:
    """Every NVMe array of ``store``, bucket by bucket, as it is now (memory or disk)."""
    out = {}
    for name, arr in store.arrays().items():
        if arr.home != "nvme":
            continue
        parts = []
        for i in range(len(arr.buckets)):
            h = store.acquire(name, i)
            parts.append(h.tensor.clone())
            store.release(h)
        out[name] = torch.cat(parts) if parts else torch.empty(0, dtype=arr.dtype)
    return out


class OptimizerScenario:
    """Single process: a ZeroMuon optimizer on a store of 4 KiB buckets (a pool of four),
    one step, then, armed: a step, ``save_checkpoint`` of step 2, and close. Before that,
    unarmed, generation 1 is saved: the one that must load bit-exact whatever happens."""

    def __init__(self, root: str):
        from offload_engine.checkpoint import save_checkpoint
        self.root = root
        self.ck = os.path.join(root, "ck")
        self.store_dir = os.path.join(root, "state")
        self.model, self.opt = make_optimizer(self.store_dir)
        set_grads(self.model, 0)
        self.opt.step()
        save_checkpoint(self.ck, self.model, self.opt, 1)
        self.gen1 = capture(self.model, self.opt)
        self.gen2 = None          # what generation 2 must hold (the state at its save)
        self.raw = None           # every store array's bytes before close
        self.store_root = self.opt.store.root

    def ops(self) -> list[Op]:
        return [Op("step", self.step, retry=False), Op("save", self.save),
                Op("capture", self.capture_store, armed=False, retry=False),
                Op("close", self.opt.close, retry=False)]

    def step(self) -> None:
        set_grads(self.model, 1)
        self.opt.step()

    def save(self) -> None:
        """Save generation 2; run again after an error, unless the error came after its
        commit (the rename) and only ``latest`` was not replaced: the generation is
        committed then, and saving it again is refused (checkpoint/checkpoint_dir.py)."""
        from offload_engine.checkpoint import save_checkpoint
        if os.path.isdir(os.path.join(self.ck, "step-00000002")):
            return
        self.gen2 = capture(self.model, self.opt)
        save_checkpoint(self.ck, self.model, self.opt, 2)

    def capture_store(self) -> None:
        held = [b.key for b in self.opt.store._resident if b.refs > b.keeps]
        assert not held, f"buckets still lent after the error: {held}"
        self.raw = store_bytes(self.opt.store)

    def check_recovered(self, outcome: Outcome) -> None:
        from offload_engine.checkpoint import load_checkpoint
        from offload_engine.layout import FlatArray
        from offload_engine.io import AsyncFileIO
        if self.opt.store is not None:  # the close did not run: close now, with no fault
            self.opt.close()
        closed_with_error = any(name == "close" for name, _ in outcome.errors)
        if not closed_with_error:
            # nothing the store held was lost: on disk, every array is what it held
            with AsyncFileIO(threads=1, queue_depth=1) as io:
                for name, want in self.raw.items():
                    got = FlatArray.open(os.path.join(self.store_root, name), io=io).read()
                    assert torch.equal(got, want), f"store array {name} lost bytes"
        # the generations: 1 always, 2 when committed
        for tag, want in (("step-00000001", self.gen1), ("step-00000002", self.gen2)):
            if tag.endswith("2") and not os.path.isdir(os.path.join(self.ck, tag)):
                continue
            model, opt = make_optimizer(os.path.join(self.root, f"load-{tag}"), seed=77)
            try:
                assert load_checkpoint(self.ck, model, opt, tag=tag) == int(tag[-1])
                assert_same(model, opt, want, f"{tag} loaded")
            finally:
                opt.close()
        with open(os.path.join(self.ck, "latest")) as f:
            latest = f.read().strip()
        assert latest in ("step-00000001", "step-00000002")
        assert os.path.isdir(os.path.join(self.ck, latest)), f"latest names {latest}, absent"


class OptimizerOpenScenario:
    """A ZeroMuon optimizer opening its store (folder, lock, group, arrays, shard table,
    manifest), one step, close; then, unarmed, opened again on the same folder: the step's
    state must be there (when close succeeded) and nothing may block the reopening."""

    def __init__(self, root: str):
        self.root = root
        self.store_dir = os.path.join(root, "state")
        self.model = self.opt = None
        self.raw = None

    def ops(self) -> list[Op]:
        return [Op("open", self.open), Op("step", self.step, retry=False),
                Op("capture", self.capture_store, armed=False, retry=False),
                Op("close", self.close, retry=False)]

    def open(self) -> None:
        if self.opt is None:
            self.model, self.opt = make_optimizer(self.store_dir)

    def step(self) -> None:
        set_grads(self.model, 0)
        self.opt.step()

    def capture_store(self) -> None:
        held = [b.key for b in self.opt.store._resident if b.refs > b.keeps]
        assert not held, f"buckets still lent after the error: {held}"
        self.raw = store_bytes(self.opt.store)

    def close(self) -> None:
        opt, self.opt = self.opt, None
        opt.close()

    def check_recovered(self, outcome: Outcome) -> None:
        from offload_engine.io import AsyncFileIO
        from offload_engine.layout import FlatArray
        from offload_engine.store import TieredStore
        if self.opt is not None:
            self.opt.close()
        closed_with_error = any(name == "close" for name, _ in outcome.errors)
        store_root = os.path.join(self.store_dir, "rank0")
        # the write lock was released and the group is whole: the store opens again
        TieredStore({"nvme_paths": [store_root], "cpu_budget": 4 * B, "bucket_bytes": B}).close()
        if not closed_with_error:  # nothing the store held was lost
            with AsyncFileIO(threads=1, queue_depth=1) as io:
                for name, want in self.raw.items():
                    got = FlatArray.open(os.path.join(store_root, name), io=io).read()
                    assert torch.equal(got, want), f"store array {name} lost bytes"
