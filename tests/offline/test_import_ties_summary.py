"""`import deepspeed` carries a run's tied names over (the imported checkpoint consolidates
with the tied name, as the DeepSpeed checkpoint itself does) and sums up its disagreements
with ZeroMuon's default rule instead of printing one line per matrix (issue 31, item 4)."""

import json
import os

import torch

from offload_engine.cli.main import main
from offload_engine.consolidate import convert_to_safetensors, get_fp32_state_dict
from offload_engine.formats.ours import OursSource
from offload_engine.migrate import from_deepspeed
from offload_engine.offline.ds_import import disagreement_summary
from offload_engine.offline.import_plan import Disagreement

from helpers import paths
from helpers.consolidate_outputs import load_output

GPT2 = os.path.join(paths.FIXTURES, "deepspeed_hf", "gpt2_zero3_w2_tied")
ZERO2_TIED = os.path.join(paths.FIXTURES, "deepspeed", "zero2_w3_fp32")
ADAMW_RUN = os.path.join(paths.FIXTURES, "deepspeed_import", "zero3_w2_fp32_adamw")


def test_imported_checkpoint_consolidates_with_the_tied_name_as_the_direct_path(tmp_path):
    summary = from_deepspeed(GPT2, str(tmp_path / "ck"), 2)
    tie = {"lm_head.weight": "transformer.wte.weight"}
    assert summary.tied == tie
    with OursSource.open_checkpoint(str(tmp_path / "ck")) as src:
        assert src.aliases() == tie
    direct = convert_to_safetensors(GPT2, str(tmp_path / "direct"), copy_config=False)
    imported = convert_to_safetensors(str(tmp_path / "ck"), str(tmp_path / "imported"),
                                      copy_config=False)
    assert imported.aliases == direct.aliases == tie
    got, aliases = load_output(tmp_path / "imported")
    want, _ = load_output(tmp_path / "direct")
    assert aliases == tie and got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    state = get_fp32_state_dict(str(tmp_path / "ck"))
    assert state["lm_head.weight"] is state["transformer.wte.weight"]


def test_zero2_tie_is_recorded_in_the_manifest(tmp_path):
    summary = from_deepspeed(ZERO2_TIED, str(tmp_path), 3)
    assert summary.tied == {"head.weight": "emb.weight"}
    with OursSource.open_checkpoint(str(tmp_path)) as src:
        assert src.aliases() == {"head.weight": "emb.weight"}


def test_an_untied_run_records_no_ties(tmp_path):
    assert from_deepspeed(ADAMW_RUN, str(tmp_path), 2).tied == {}
    with OursSource.open_checkpoint(str(tmp_path)) as src:
        assert src.aliases() == {}


def test_48_disagreements_are_one_line_with_a_count_and_examples():
    layers = [f"h.{i}.{m}.weight" for i in range(8)
              for m in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.up", "mlp.down")]
    lines = disagreement_summary([Disagreement(n, "adamw", "muon") for n in layers]
                                 + [Disagreement("head.weight", "muon", "adamw")])
    assert lines == [
        "48 parameters used adamw in the DeepSpeed run where ZeroMuon's default rule picks "
        "muon; imported as adamw (h.0.attn.q.weight, h.0.attn.k.weight, h.0.attn.v.weight "
        "and 45 more)",
        "1 parameter used muon in the DeepSpeed run where ZeroMuon's default rule picks "
        "adamw; imported as muon (head.weight)"]
    assert disagreement_summary([]) == []


def test_cli_prints_the_summary_and_lists_each_with_verbose(tmp_path, capsys):
    assert main(["import", "deepspeed", ADAMW_RUN, str(tmp_path / "a"), "--world-size", "2"]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("disagreement:")]
    assert lines == ["disagreement: 2 parameters used adamw in the DeepSpeed run where ZeroMuon's "
                     "default rule picks muon; imported as adamw (l1.weight, l2.weight) "
                     "(--verbose lists each, --json has them all)"]
    assert main(["import", "deepspeed", ADAMW_RUN, str(tmp_path / "b"), "--world-size", "2",
                 "--verbose"]) == 0
    err = capsys.readouterr().err
    assert [line.split(":")[1].strip() for line in err.splitlines()
            if line.startswith("disagreement:")] == ["l1.weight", "l2.weight"]
    assert main(["import", "deepspeed", GPT2, str(tmp_path / "c"), "--world-size", "2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tied"] == {"lm_head.weight": "transformer.wte.weight"}
