"""optim/: ZeroMuon, a ZeRO-3 Muon + AdamW optimizer on FSDP2 with state in the TieredStore.

See docs/optim.md. ``default_use_muon`` is the one rule that decides which parameters use
Muon; other layers (plan, cli) reuse it.
"""

from .param_rules import default_use_muon
from .stats import StepStats
from .state_io import split_state_dict
from .zero_muon import ZeroMuon

__all__ = ["StepStats", "ZeroMuon", "default_use_muon", "split_state_dict"]
