"""The health plot's x-axis is in the model's order, not the checkpoint's optimizer-group order."""

from offload_engine.checkpoint import save_checkpoint
from offload_engine.demo.model import build_model
from offload_engine.formats import open_source
from offload_engine.offline.health import layer_of
from offload_engine.offline.plot import layer_norms
from offload_engine.optim import ZeroMuon


def test_plotted_layers_follow_the_models_parameter_order(tmp_path):
    model = build_model("tiny")
    opt = ZeroMuon(model.named_parameters(), lr=0.02,
                   store={"nvme_paths": [str(tmp_path / "store")], "bucket_bytes": 4096,
                          "cpu_budget": 1 << 20})
    ckpt = str(tmp_path / "ckpt")
    save_checkpoint(ckpt, model, opt, 0)
    opt.close()
    with open_source(ckpt) as source:
        listed = [t.name for t in source.tensors()]   # the manifest: Muon group, then AdamW
    want = list(dict.fromkeys(layer_of(n) for n, _ in model.named_parameters()))
    assert list(dict.fromkeys(layer_of(n) for n in listed)) != want   # what was plotted

    stats = {(n, "param"): {"sumsq": float(i + 1)} for i, n in enumerate(listed)}
    layers, norms = layer_norms(stats, listed)       # x tick labels and y values drawn
    assert layers == want
    first = want.index(layer_of(listed[0]))
    assert norms["param"][first] > 0 and len(norms["param"]) == len(want)
