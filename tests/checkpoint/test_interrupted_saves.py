"""Ctrl-C (or SIGTERM's SystemExit) landing in the middle of an asynchronous save neither
hangs the next save nor is swallowed (issue 30: BaseException-safe bookkeeping). Before the
fix, an interrupt while a save waited for the previous one was logged as that save's
failure and training went on (the run ignored SIGTERM); and an interrupt after the save
was registered but before its thread started left the next save waiting forever."""

import os
import types

import pytest
import torch

from helpers.deadline import within
from helpers.checkpoint_runs import small_run
from offload_engine.checkpoint import load_checkpoint, save_checkpoint, save_checkpoint_async
from offload_engine.checkpoint.pending import PENDING_ATTR, PendingCheckpoint, finish_previous


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_while_waiting_for_the_previous_save_goes_on(interrupt):
    class Interrupted:
        def wait(self, timeout=None):
            raise interrupt()  # Ctrl-C (or SIGTERM's SystemExit) while waiting

    previous = PendingCheckpoint("/nowhere/step-00000001", 1)
    previous._finished = Interrupted()
    opt = types.SimpleNamespace(**{PENDING_ATTR: previous})
    with pytest.raises(interrupt):
        finish_previous(opt)


def test_an_interrupt_before_the_saves_thread_starts_does_not_hang_the_next(tmp_path,
                                                                           monkeypatch):
    model, opt = small_run(str(tmp_path), steps=1)
    ckpt = str(tmp_path / "ckpt")
    run = PendingCheckpoint._run

    def interrupted(self, *args):  # Ctrl-C lands as the thread is about to start
        monkeypatch.setattr(PendingCheckpoint, "_run", run)
        raise KeyboardInterrupt

    monkeypatch.setattr(PendingCheckpoint, "_run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint_async(ckpt, model, opt, 1)
    saved_at_1 = {n: p.detach().clone() for n, p in model.named_parameters()}
    # the handler's save: it finishes the first one (its thread never ran), then its own
    within(60, lambda: save_checkpoint(ckpt, model, opt, 2, tag="interrupt"))
    assert sorted(n for n in os.listdir(ckpt) if not n.startswith(".")) == \
        ["interrupt", "latest", "step-00000001"]
    opt.close()
    again, opt2 = small_run(str(tmp_path), steps=0, name="again")
    assert load_checkpoint(ckpt, again, opt2, tag="step-00000001") == 1
    for n, p in again.named_parameters():
        assert torch.equal(p, saved_at_1[n]), n
    opt2.close()
