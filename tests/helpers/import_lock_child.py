"""A child process holding a checkpoint folder for writing, for the import deepspeed lock
tests (tests/offline/test_import_writer_lock.py): it writes ``<ready>`` once it holds the
folder and waits (30 s at most) for ``<go>`` before it lets go.

    python -m helpers.import_lock_child train CKPT READY GO
        a training: saves step 1 into CKPT (taking the writer lock), waits, closes.
    python -m helpers.import_lock_child import DS_CKPT CKPT READY GO
        ``offload-engine import deepspeed DS_CKPT CKPT --world-size 2``, paused just
        before its commit; exits with the command's code."""

from __future__ import annotations

import os
import sys
import time


def hold_until_go(ready: str, go: str) -> None:
    with open(ready, "w"):
        pass
    deadline = time.monotonic() + 30
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.05)


def main(argv: list[str]) -> int:
    if argv[0] == "train":
        from offload_engine.checkpoint import save_checkpoint
        from helpers.forged import fresh_model, train
        ckpt, ready, go = argv[1:]
        model, opt = fresh_model(ckpt + ".store")
        train(model, opt, [1])
        save_checkpoint(ckpt, model, opt, 1)
        hold_until_go(ready, go)
        opt.close()
        return 0
    from offload_engine.cli import main as cli
    from offload_engine.offline import import_writer
    ds_ckpt, ckpt, ready, go = argv[1:]
    commit = import_writer.commit

    def paused_commit(*args, **kwargs):
        hold_until_go(ready, go)
        return commit(*args, **kwargs)
    import_writer.commit = paused_commit
    return cli.main(["import", "deepspeed", ds_ckpt, ckpt, "--world-size", "2"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
