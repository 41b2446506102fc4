"""`config from-deepspeed` gives the training-loop lines for what DeepSpeed's engine did in
engine.step() (issue 31 item 4): gradient clipping and WarmupLR / WarmupDecayLR, the lrs of
the pasted schedule equal to DeepSpeed 0.19.8's own, step for step; and the store config it
writes leaves gpu_budget out, so a CUDA run of ZeroMuon sizes its staging itself."""

import json
import os

import pytest
import torch

from offload_engine.cli.main import main
from offload_engine.plan.deepspeed_config import translate
from offload_engine.plan.deepspeed_loop import warmup_factor
from helpers.paths import FIXTURES

RECORDING = os.path.join(FIXTURES, "deepspeed_configs", "warmup_lrs_deepspeed_0.19.8.json")

DS = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5,
      "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
      "scheduler": {"type": "WarmupDecayLR",
                    "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4,
                               "warmup_num_steps": 50, "total_num_steps": 200}},
      "zero_optimization": {"stage": 3,
                            "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}}


@pytest.mark.parametrize("kind", ["WarmupLR", "WarmupLR_linear", "WarmupDecayLR"])
def test_pasted_schedule_gives_deepspeeds_lrs(kind):
    """The recording: DeepSpeed 0.19.8's scheduler on an SGD optimizer, lr after construction
    and after each of 220 steps (made with /work/dsvenv; see the file's keys)."""
    with open(RECORDING) as f:
        want = json.load(f)[kind]
    kw = dict(want["kw"])
    total = kw.pop("total_num_steps", None)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=kw["warmup_max_lr"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_factor(s, kw, total))
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(len(want["lrs"]) - 1):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == pytest.approx(want["lrs"], rel=1e-12, abs=1e-18)


def test_translation_carries_the_loop_lines_and_runs_them():
    t = translate(DS)
    assert t.loop_code["gradient_clipping"] == [
        "torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # before opt.step()"]
    report = {r.key: r for r in t.report}
    assert "clip_grad_norm_(model.parameters(), 0.5)" in report["gradient_clipping"].rule
    assert "training loop" in report["scheduler.type"].rule
    # the lines run as pasted, on a real optimizer
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=3e-4)
    model(torch.ones(1, 4)).sum().backward()
    scope = {"torch": torch, "model": model, "opt": opt}
    exec("\n".join(t.loop_code["gradient_clipping"] + t.loop_code["scheduler"][:2]), scope)
    scope["sched"].step()
    assert opt.param_groups[0]["lr"] == 0.0    # DeepSpeed's first two steps at warmup_min_lr


def test_other_schedulers_keep_the_generic_advice():
    t = translate({**DS, "scheduler": {"type": "OneCycle", "params": {}}})
    assert "scheduler" not in t.loop_code
    assert "build a torch.optim.lr_scheduler" in {r.key: r for r in t.report}["scheduler.type"].rule


def test_written_store_config_leaves_gpu_budget_out(tmp_path, capsys):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(DS))
    out = tmp_path / "store.json"
    assert main(["config", "from-deepspeed", str(cfg), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "training loop" in text and "clip_grad_norm_" in text
    assert "gpu_budget" not in json.loads(out.read_text())
