"""``offload-engine import deepspeed`` is a writer of the checkpoint folder like a training
(issue 30, item 2): it holds the folder's writer lock while it imports, so an import into a
folder a live training saves into is refused naming the training's process, and a training
saving into a folder being imported into is refused naming the import's; nothing either
wrote is lost. Real processes: the lock is one per process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from offload_engine.checkpoint import load_checkpoint, save_checkpoint
from offload_engine.checkpoint.writer_lock import CheckpointLockedError
from offload_engine.cli import main as cli
from offload_engine.migrate import imported_state

from helpers import paths
from helpers.forged import fresh_model, train
from helpers.paths import child_env

DS_RUN = os.path.join(paths.FIXTURES, "deepspeed_import", "zero2_w2_bf16_adamw")


def start_holder(tmp_path, *args: str):
    """A child holding the folder (helpers/import_lock_child.py), once it says it does;
    ``(process, go file)``."""
    ready, go = str(tmp_path / "ready"), str(tmp_path / "go")
    child = subprocess.Popen([sys.executable, "-m", "helpers.import_lock_child", *args,
                              ready, go], env=child_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(ready):
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "the child never took the folder"
        time.sleep(0.05)
    return child, go


def let_go(child, go: str):
    with open(go, "w"):
        pass
    out, err = child.communicate(timeout=120)
    return child.returncode, err


@pytest.mark.multiprocess
def test_an_import_into_a_folder_a_live_training_holds_is_refused(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    child, go = start_holder(tmp_path, "train", ck)
    try:
        code = cli.main(["import", "deepspeed", DS_RUN, ck, "--world-size", "2"])
        err = capsys.readouterr().err
    finally:
        rc, child_err = let_go(child, go)
    assert rc == 0, child_err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "already being written by" in err and f"process {child.pid}" in err
    assert sorted(os.listdir(ck)) == [".writer-lock", "latest", "step-00000001"]
    model, opt = fresh_model(str(tmp_path / "reader"), seed=3)
    assert load_checkpoint(ck, model, opt) == 1  # the training's generation is intact
    opt.close()


@pytest.mark.multiprocess
def test_a_training_saving_into_a_folder_being_imported_into_is_refused(tmp_path):
    ck = str(tmp_path / "ck")
    child, go = start_holder(tmp_path, "import", DS_RUN, ck)
    model, opt = fresh_model(str(tmp_path / "train"))
    try:
        train(model, opt, [1])
        with pytest.raises(CheckpointLockedError, match=f"already being written by process "
                                                        f"{child.pid} "):
            save_checkpoint(ck, model, opt, 5)
    finally:
        rc, err = let_go(child, go)
    assert rc == 0, err
    assert imported_state(ck)["global_steps"] > 0  # the import committed, whole
    assert not [n for n in os.listdir(ck) if n.startswith("step-00000005")]
    save_checkpoint(ck, model, opt, 5)  # the import let go: the folder takes a writer again
    w = model.w.detach().clone()
    opt.close()
    model2, opt2 = fresh_model(str(tmp_path / "reader"), seed=3)
    assert load_checkpoint(ck, model2, opt2) == 5
    assert torch.equal(model2.w, w)
    opt2.close()
