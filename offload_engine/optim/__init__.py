"""optim/: ZeroMuon, a ZeRO-3 Muon + AdamW optimizer on FSDP2 with state in the TieredStore.

See docs/optimizer.md. ``default_use_muon`` is the one rule that decides which parameters use
Muon; other layers (plan, cli) reuse it. ``ZeroMuon`` and the state-dict helpers are
imported on first use: they pull in torch and torch.distributed, which the planner never
needs (the layout, owners and manifest modules it uses are pure).
"""

from .param_rules import default_use_muon, use_muon_for
from .step_stats import StepStats

__all__ = ["StepStats", "ZeroMuon", "default_use_muon", "split_state_dict", "use_muon_for"]


def __getattr__(name: str):
    if name == "ZeroMuon":
        from .zero_muon import ZeroMuon
        return ZeroMuon
    if name == "split_state_dict":
        from .state_io import split_state_dict
        return split_state_dict
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
