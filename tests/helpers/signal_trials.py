"""SIGINT and SIGTERM at random moments of a small training loop (issue 30, "Must show").

Run as a script: ``python signal_trials.py ROOT TRIALS SEED PARALLEL DEADLINE_S``. It imports
torch once, then forks each trial (PARALLEL at a time): a ZeroMuon run on an NVMe store
through a small pinned pool, an asynchronous checkpoint save after every step, and the
usual handler: Ctrl-C (KeyboardInterrupt) or SIGTERM (a handler that calls ``sys.exit``)
lands anywhere, and the ``except`` saves a checkpoint, the ``finally`` closes the optimizer.
Before each save the trial records the state it saves (model and optimizer state dicts,
materialised). The driver sends the trial's signal a seeded random delay after the loop
started, kills it at DEADLINE_S (a hang), and then checks, in a fresh process per trial,
that every committed generation loads bit-exact against the record of its name and that
``latest`` names the one the handler saved. Prints one JSON line: a result per trial.
"""

from __future__ import annotations

import faulthandler
import json
import os
import random
import select
import signal
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402  (imported once, before the trials are forked)

from helpers.zero_muon_harness import Bag  # noqa: E402
from offload_engine.checkpoint import load_checkpoint, save_checkpoint, save_checkpoint_async  # noqa: E402
from offload_engine.optim import ZeroMuon  # noqa: E402

SHAPES = {"embed_tokens": (11, 6), "w_big": (96, 64), "w_tall": (24, 8), "norm_weight": (8,)}
MAX_STEPS = 10_000
DELAY_S = (0.0, 2.0)  # the signal lands this long after the loop started


def store(path: str) -> dict:
    # 4 KiB buckets through a 16 KiB pool: the state (about 60 KiB) moves every step
    return {"nvme_paths": [path], "bucket_bytes": 4096, "cpu_budget": 16384,
            "prefetch_depth": 1, "io_threads": 2, "acquire_timeout_s": 30}


def optimizer(model, path: str) -> ZeroMuon:
    return ZeroMuon(model.named_parameters(), lr=0.02, adamw=dict(lr=3e-3), store=store(path))


def materialised(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: materialised(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [materialised(v) for v in x]
    return x


def record(trial: str, name: str, model, opt) -> None:
    """What generation ``name`` holds, written before its save starts (so that any
    generation that commits has its record)."""
    rec = {"model": materialised(model.state_dict()), "opt": materialised(opt.state_dict())}
    path = os.path.join(trial, "records", name + ".pt")
    torch.save(rec, path + ".tmp")
    os.replace(path + ".tmp", path)


def train(trial: str, ready_fd: int, deadline_s: float) -> int:
    """One trial's process: train and save until a signal lands; then save and close."""
    torch.set_num_threads(1)
    forked = time.monotonic()
    faulthandler.dump_traceback_later(deadline_s - 2, exit=True)  # a hang shows its stacks
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    os.makedirs(os.path.join(trial, "records"))
    ckpt = os.path.join(trial, "ckpt")
    model = Bag(SHAPES, 0)
    opt = optimizer(model, os.path.join(trial, "store"))
    watch(opt, forked + deadline_s - 4)
    step = 0
    os.write(ready_fd, b"r")  # the driver's clock for the signal starts here
    os.close(ready_fd)
    try:
        while step < MAX_STEPS:
            g = torch.Generator().manual_seed(step)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
            step += 1
            record(trial, f"step-{step:08d}", model, opt)
            save_checkpoint_async(ckpt, model, opt, step, keep_last=2)
        print("the loop ended before the signal", flush=True)
        return 3
    except (KeyboardInterrupt, SystemExit) as e:  # the usual handler: save, then close
        print(f"interrupted by {type(e).__name__} after step {step}", flush=True)
        tag = f"interrupt-{step}"
        record(trial, tag, model, opt)
        save_checkpoint(ckpt, model, opt, step, tag=tag)
        print(f"saved {tag}", flush=True)
        return 0
    finally:
        opt.close()
        print("closed", flush=True)


def watch(opt, at: float) -> None:
    """Print the store's buckets and write-backs if the trial still runs at ``at`` (a
    ``time.monotonic`` time: what a hang waits for; the stacks follow from faulthandler)."""
    def report():
        time.sleep(max(0.0, at - time.monotonic()))
        store = opt.store
        if store is None:
            return
        print("still running; buckets (key, state, refs, keeps, dirty, saving, error):", sorted(
            (b.key, b.state, b.refs, b.keeps, b.dirty, b.saving, b.error)
            for b in list(store._resident)),
            "write-backs in flight:", store.writes_in_flight, "pool in use:",
            store.pool.in_use, "snapshot:", store._snapshot, flush=True)

    threading.Thread(target=report, daemon=True).start()


def committed(ckpt: str) -> list[str]:
    if not os.path.isdir(ckpt):
        return []
    return sorted(n for n in os.listdir(ckpt)
                  if not n.startswith(".") and n != "latest" and not n.endswith(".partial")
                  and os.path.isdir(os.path.join(ckpt, n)))


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def verify(trial: str) -> dict:
    """Every committed generation of the trial against its record; what ``latest`` names."""
    torch.set_num_threads(1)
    ckpt = os.path.join(trial, "ckpt")
    out = {"generations": committed(ckpt), "problems": []}
    try:
        with open(os.path.join(ckpt, "latest")) as f:
            out["latest"] = f.read().strip()
    except OSError as e:
        out["latest"] = None
        out["problems"].append(f"no latest: {e}")
    for i, name in enumerate(out["generations"]):
        rec_path = os.path.join(trial, "records", name + ".pt")
        if not os.path.exists(rec_path):
            out["problems"].append(f"{name}: committed, but no record of what was saved")
            continue
        model = Bag(SHAPES, 1)
        opt = optimizer(model, os.path.join(trial, f"verify-store-{i}"))
        try:
            load_checkpoint(ckpt, model, opt, tag=name)
            got = {"model": materialised(model.state_dict()), "opt": materialised(opt.state_dict())}
        except BaseException as e:  # noqa: BLE001 - reported
            out["problems"].append(f"{name}: does not load: {type(e).__name__}: {e}")
            continue
        finally:
            opt.close()
        if not same(torch.load(rec_path), got):
            out["problems"].append(f"{name}: loads, but differs from what was saved")
    return out


def fork_to(fn, log_path: str, *args) -> int:
    """Run ``fn(*args)`` in a forked child whose output goes to ``log_path``; its return
    value is the child's exit status."""
    pid = os.fork()
    if pid:
        return pid
    code = 70
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        faulthandler.enable()
        code = fn(*args)
    except BaseException:  # noqa: BLE001 - the log says what
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 0)


def run_trials(root: str, trials: int, seed: int, parallel: int, deadline_s: float) -> list[dict]:
    rng = random.Random(seed)
    todo = [{"trial": i, "signal": rng.choice(["SIGINT", "SIGTERM"]),
             "delay_s": round(rng.uniform(*DELAY_S), 3)} for i in range(trials)]
    todo.reverse()
    running, results = {}, []
    while todo or running:
        while todo and len(running) < parallel:
            t = todo.pop()
            t["dir"] = os.path.join(root, f"trial-{t['trial']:03d}")
            os.makedirs(t["dir"])
            r, w = os.pipe()
            pid = fork_to(_trial, os.path.join(t["dir"], "log.txt"), t["dir"], r, w, deadline_s)
            os.close(w)
            t.update(pid=pid, ready_fd=r, started=time.monotonic(), ready=None, sent=False)
            running[pid] = t
        now = time.monotonic()
        for pid, t in list(running.items()):
            if t["ready"] is None and select.select([t["ready_fd"]], [], [], 0)[0]:
                os.read(t["ready_fd"], 1)
                os.close(t["ready_fd"])
                t["ready"] = now
            if t["ready"] is not None and not t["sent"] and now - t["ready"] >= t["delay_s"]:
                os.kill(pid, getattr(signal, t["signal"]))
                t["sent"] = True
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                t["exit"] = os.waitstatus_to_exitcode(status)
            elif now - t["started"] > deadline_s:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                t["exit"], t["hang"] = "killed at the deadline", True
            else:
                continue
            if t["ready"] is None:
                os.close(t["ready_fd"])
            del running[pid]
            results.append(t)
        time.sleep(0.005)
    # verify in fresh forked processes, PARALLEL at a time
    pending = list(results)
    checking = {}
    while pending or checking:
        while pending and len(checking) < parallel:
            t = pending.pop()
            out_path = os.path.join(t["dir"], "verify.json")
            pid = fork_to(_verify_to, os.path.join(t["dir"], "verify-log.txt"), t["dir"], out_path)
            checking[pid] = (t, out_path)
        pid, _ = os.wait()
        t, out_path = checking.pop(pid)
        try:
            with open(out_path) as f:
                t.update(json.load(f))
        except OSError:
            t["problems"] = ["the check itself failed: see verify-log.txt"]
    for t in results:
        for k in ("pid", "ready_fd", "started", "ready", "sent"):
            t.pop(k, None)
        t.setdefault("hang", False)
        problems = t.setdefault("problems", [])
        if t["hang"] or t["exit"] != 0:
            problems.insert(0, f"exit {t['exit']}")
        elif not (t.get("latest") or "").startswith("interrupt-"):
            problems.append(f"latest names {t.get('latest')!r}, not the handler's save")
        if problems:
            with open(os.path.join(t["dir"], "log.txt"), errors="replace") as f:
                t["log_tail"] = f.read()[-4000:]
    return sorted(results, key=lambda t: t["trial"])


def _trial(trial: str, ready_r: int, ready_w: int, deadline_s: float) -> int:
    os.close(ready_r)  # the driver's end
    return train(trial, ready_w, deadline_s)


def _verify_to(trial: str, out_path: str) -> int:
    with open(out_path, "w") as f:
        json.dump(verify(trial), f)
    return 0


if __name__ == "__main__":
    root, trials, seed, parallel, deadline = sys.argv[1:6]
    print(json.dumps(run_trials(root, int(trials), int(seed), int(parallel), float(deadline))))
