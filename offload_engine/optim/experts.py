"""Which 3-D parameters are stacks of expert matrices, beyond the default rule's names.

The default rule (``param_rules.use_muon_for``) knows a stack by its module name
``experts``. A model that names its grouped experts otherwise passes ``expert_params=`` to
ZeroMuon: a regular expression searched in the parameter's name, or a predicate
``f(name, param) -> bool``. Either only ever marks 3-D parameters (dim 0 the expert); a
matched parameter of another rank is an error, since it cannot be a stack.

Every other parameter that is neither a matrix nor a stack (a conv filter, a 3-D tensor
named otherwise) stays on AdamW, and ZeroMuon names them all in one log line so that an
expert stack the rule missed does not go to AdamW silently.
"""

from __future__ import annotations

import logging
import re

from .param_rules import default_use_muon
from ..errors import InputError, UsageError

log = logging.getLogger("offload_engine.optim.zero_muon")


def expert_matcher(expert_params):
    """``f(name, param) -> bool`` from ``expert_params`` (None, a regex string or a predicate)."""
    if expert_params is None:
        return lambda name, param: False
    if isinstance(expert_params, str):
        try:
            pattern = re.compile(expert_params)
        except re.error as e:
            raise InputError(f"expert_params {expert_params!r} is not a regular expression: {e}")
        return lambda name, param: bool(name) and pattern.search(name) is not None
    if callable(expert_params):
        return expert_params
    raise InputError(f"expert_params must be a regular expression string or a function "
                     f"f(name, param) -> bool, got {type(expert_params).__name__}")


def with_experts(use_muon_rule, expert_params):
    """The rule that splits groups: ``use_muon_rule``, plus the stacks ``expert_params``
    names when the rule is the default one. With a rule of your own, your rule decides
    (a 3-D parameter it puts on Muon is a stack on dim 0), so both at once is refused."""
    if expert_params is None:
        return use_muon_rule
    if use_muon_rule is not default_use_muon:
        raise UsageError("ZeroMuon: give expert_params or use_muon_rule, not both: your "
                         "use_muon_rule decides every parameter (return True for the expert "
                         "stacks, which are then Muon matrices along dim 0)")
    matches = expert_matcher(expert_params)

    def rule(name, param) -> bool:
        if matches(name, param):
            if param.ndim != 3:
                raise InputError(f"expert_params matched parameter {name} of shape "
                                 f"{list(param.shape)}: a stack of expert matrices is 3-D "
                                 "[num_experts, out, in]")
            return True
        return default_use_muon(name, param)
    return rule


def report_non_matrices(infos) -> None:
    """One log line naming every AdamW parameter of 3 or more dimensions (not a matrix, not a
    vector, not a recognised expert stack), with how to put expert stacks on Muon."""
    odd = [f"{i.name or i.index} {list(i.shape)}" for i in infos
           if i.kind == "adamw" and len(i.shape) >= 3]
    if odd:
        log.warning("ZeroMuon: %d parameter(s) of 3 or more dimensions stay on AdamW: %s (a "
                    "stack of expert matrices [num_experts, out, in] goes to Muon when a module "
                    "in its name is 'experts' or expert_params= names it)",
                    len(odd), ", ".join(odd))
