"""The Python API of ``offload-engine import``: bring a DeepSpeed run over to ZeroMuon.

    from offload_engine.migrate import from_deepspeed, imported_state, use_muon_rule
    summary = from_deepspeed("ds_ckpt/", "ckpt/", world_size=8)   # once, offline
    # on each rank of the new run:
    opt = ZeroMuon(model.named_parameters(), use_muon_rule=use_muon_rule("ckpt/"), ...)
    step = load_checkpoint("ckpt/", model, opt)
    scheduler.load_state_dict(imported_state("ckpt/")["lr_scheduler"])

See ``offline/ds_import.py`` and docs/migrate.md ("Importing a DeepSpeed checkpoint").
"""

from .offline.ds_import import ImportSummary, from_deepspeed, imported_state, use_muon_rule

__all__ = ["ImportSummary", "from_deepspeed", "imported_state", "use_muon_rule"]
