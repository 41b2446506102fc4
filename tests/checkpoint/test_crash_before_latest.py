"""A crash between the commit rename and the update of ``latest`` (checkpoint/checkpoint_dir.py)
leaves generation N committed while ``latest`` still names N-1. The documented resume
(load latest, train, save the next step) used to fail with ``FileExistsError ... step N is
already committed``. Now the save keeps the orphan's bytes as ``<name>.superseded-<k>``
(never loaded), says so in a warning naming it, and saves. The same holds for a timeline
that ``latest`` was rolled back from by hand.

The crash is real: a child process saves with ``write_latest`` replaced by an exit, so it
dies right after the rename and its fsync, as a kill there would."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from helpers.forged import fresh_model, train
from helpers.paths import child_env
from offload_engine.checkpoint import load_checkpoint, save_checkpoint
from offload_engine.cli.main import main

def tree_digest(path: str) -> dict[str, str]:
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                out[os.path.relpath(os.path.join(d, f), path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


CRASHING_RUN = textwrap.dedent("""
    import os
    from helpers.forged import fresh_model, train
    from offload_engine.checkpoint import checkpoint_dir, save_checkpoint
    tmp = {tmp!r}
    model, opt = fresh_model(os.path.join(tmp, "run1"))
    train(model, opt, range(0, 3))
    save_checkpoint(os.path.join(tmp, "ck"), model, opt, 3)
    train(model, opt, range(3, 4))
    def crash(ckpt_dir, name):  # the process dies after the rename, before latest
        os._exit(17)
    checkpoint_dir.write_latest = crash
    save_checkpoint(os.path.join(tmp, "ck"), model, opt, 4)
    print("not reached")
""")


@pytest.mark.multiprocess
def test_resume_after_a_crash_before_latest(tmp_path, caplog):
    tmp = str(tmp_path)
    p = subprocess.run([sys.executable, "-c", CRASHING_RUN.format(tmp=tmp)],
                       capture_output=True, text=True, timeout=300, env=child_env())
    assert p.returncode == 17, p.stderr
    ck = os.path.join(tmp, "ck")
    with open(os.path.join(ck, "latest")) as f:
        assert f.read() == "step-00000003\n"
    orphan = os.path.join(ck, "step-00000004")
    assert os.path.isdir(orphan)
    before = tree_digest(orphan)

    # the documented resume: load latest, train, save the next step
    model, opt = fresh_model(os.path.join(tmp, "run2"), seed=5)
    try:
        assert load_checkpoint(ck, model, opt) == 3
        train(model, opt, range(3, 4))
        with caplog.at_level(logging.WARNING):
            save_checkpoint(ck, model, opt, 4)
        w = model.w.detach().clone()
    finally:
        opt.close()
    aside = orphan + ".superseded-1"
    assert tree_digest(aside) == before  # nothing committed is lost
    assert any(aside in r.getMessage() and "never loaded" in r.getMessage()
               for r in caplog.records), caplog.text
    with open(os.path.join(ck, "latest")) as f:
        assert f.read() == "step-00000004\n"
    model, opt = fresh_model(os.path.join(tmp, "run3"), seed=6)
    try:
        assert load_checkpoint(ck, model, opt) == 4
        assert torch.equal(model.w.detach(), w)
    finally:
        opt.close()


def test_rolled_back_timeline_and_the_current_generation(tmp_path, caplog):
    """latest edited back to step 1: saving step 2 again sets the old step 2 aside (twice:
    .superseded-1, then -2). Saving the step latest names is still an error, as is saving
    over a generation when latest cannot be read."""
    ck = str(tmp_path / "ck")
    model, opt = fresh_model(str(tmp_path / "run"))
    try:
        save_checkpoint(ck, model, opt, 1)
        save_checkpoint(ck, model, opt, 2)
        with pytest.raises(FileExistsError, match="latest names it"):
            save_checkpoint(ck, model, opt, 2)
        for k in (1, 2):
            with open(os.path.join(ck, "latest"), "w") as f:
                f.write("step-00000001\n")  # a rollback by hand
            with caplog.at_level(logging.WARNING):
                save_checkpoint(ck, model, opt, 2)
            assert os.path.isdir(os.path.join(ck, f"step-00000002.superseded-{k}"))
        assert sorted(os.listdir(ck)) == [".writer-lock", "latest", "step-00000001", "step-00000002",
                                          "step-00000002.superseded-1",
                                          "step-00000002.superseded-2"]
        # kept readable: named on purpose, a set-aside generation still inspects
        assert main(["inspect", ck, "--tag", "step-00000002.superseded-1"]) == 0
        with open(os.path.join(ck, "latest"), "wb") as f:
            f.write(b"\xff\xfe")
        with pytest.raises(FileExistsError, match="latest cannot be read"):
            save_checkpoint(ck, model, opt, 2)
        assert os.path.isdir(os.path.join(ck, "step-00000002"))
    finally:
        opt.close()
