"""`diff STORE CKPT`: a live store against a checkpoint of its run, optimizer state by state."""

import json

from offload_engine.checkpoint import save_checkpoint
from offload_engine.cli.main import main as cli_main
from helpers.checkpoint_runs import small_run


def _diff(capsys, a: str, b: str) -> tuple[int, dict]:
    capsys.readouterr()
    rc = cli_main(["diff", a, b, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_a_store_equals_the_checkpoint_saved_from_it_and_differs_after_another_step(
        tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    model, opt = small_run(str(tmp_path), steps=3, name="saved")
    save_checkpoint(ckpt, model, opt, 3)
    opt.close()
    _, opt = small_run(str(tmp_path), steps=4, name="one_more")
    opt.close()

    # the store's root as a single process was given it (nvme_paths), and its rank folder
    for store in (str(tmp_path / "saved"), str(tmp_path / "saved" / "rank0")):
        rc, report = _diff(capsys, store, ckpt)
        assert rc == 0 and report["equal"], report
        compared = {v["state"] for v in report["values"]}
        assert compared == {"momentum_buffer", "exp_avg", "exp_avg_sq"}   # never Muon's param
        assert not report["changed"] and not report["added"] and not report["removed"]

    rc, report = _diff(capsys, str(tmp_path / "one_more"), ckpt)
    assert rc == 1 and not report["equal"]
    assert {v["state"] for v in report["values"] if not v["equal"]} >= {"momentum_buffer"}
