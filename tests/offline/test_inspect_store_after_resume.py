"""`inspect` of a live store after a resume shows the store's step, not the checkpoint's."""

import json
import os

import torch

from offload_engine.checkpoint import load_checkpoint, save_checkpoint
from offload_engine.cli.main import main as cli_main
from helpers.checkpoint_runs import small_run


def _steps(model, opt, n: int) -> None:
    for _ in range(n):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.01)
        opt.step()


def test_store_trained_on_after_a_resume_shows_the_step_it_reached(tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    model, opt = small_run(str(tmp_path), steps=3)             # steps 1-3
    save_checkpoint(ckpt, model, opt, 3)
    opt.close()
    model, opt = small_run(str(tmp_path), steps=0, name="resumed")
    assert load_checkpoint(ckpt, model, opt) == 3
    _steps(model, opt, 4)                                      # steps 4-7
    assert opt.last_step_stats.step == 7
    opt.close()
    capsys.readouterr()
    assert cli_main(["inspect", str(tmp_path / "resumed"), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [r["summary"]["step"] for r in shown["ranks"]] == [7]
    assert os.path.isdir(os.path.join(ckpt, "step-00000003"))
