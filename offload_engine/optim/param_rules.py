"""Which parameters Muon updates: the one rule the optimizer, the planner and the CLI share.

Muon orthogonalizes hidden-layer matrices. Everything else goes to AdamW: parameters that
are not matrices (biases, norm gains, scalars, conv filters) and 2-D parameters whose name
marks an embedding table or an output head (their rows are per-token vectors, not a linear
map between hidden spaces). This is the recipe of the Muon and Moonlight authors.

Mixture of experts (Moonlight's recipe: every expert a matrix of its own, the router too):

- per-expert Linear weights (``...experts.{e}.w1.weight``, Hugging Face 4.x) are 2-D: Muon;
- a **stack of expert matrices** is a 3-D parameter ``[num_experts, out, in]`` (dim 0 the
  expert) with a module named ``experts`` in its name: torchtitan's ``moe.experts.w1``,
  Hugging Face 5.x's fused ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``.
  It is E matrices to Muon, each orthogonalized on its own with its own shape's lr
  adjustment, as ``torch.optim.Muon`` on each expert slice as a 2-D parameter would. A
  fused ``gate_up_proj`` slice is one matrix (gate rows then up rows), as torch Muon on
  that slice; torchtitan keeps ``w1``/``w3`` apart and so orthogonalizes them apart;
- the router (``gate`` Linear, ``[num_experts, hidden]``) is an ordinary 2-D matrix: Muon
  (Moonlight found the router gained most);
- any other 3-D or higher parameter stays on AdamW (ZeroMuon names them in one log line).
"""

from __future__ import annotations

# module names that hold an embedding table wherever they sit in the model
_EMBEDDING_PARTS = ("wte", "wpe", "lm_head")
# module names that are an output head when they sit at the top of the model ("output.weight"
# in Llama checkpoints); deeper down, "output" is an ordinary projection (BERT's layer.N.output)
_TOP_LEVEL_HEADS = ("output", "head", "classifier", "score")
# prefixes that wrappers add in front of the user's own names
_WRAPPER_PARTS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "module")
# the module name that marks a 3-D parameter as a stack of expert matrices (dim 0 = expert)
EXPERT_MODULE = "experts"


def default_use_muon(name: str | None, param) -> bool:
    """True when ``param`` (a tensor named ``name`` as in ``model.named_parameters()``) should
    use Muon: ``use_muon_for(name, param.ndim)``. For an FSDP2 DTensor, ``param.ndim`` is
    that of the full tensor."""
    return use_muon_for(name, param.ndim)


def _modules(name: str) -> list[str]:
    """The module path of a parameter name, lower case, wrapper prefixes dropped."""
    parts = name.lower().split(".")
    while len(parts) > 1 and parts[0] in _WRAPPER_PARTS:
        parts = parts[1:]
    return parts[:-1] if len(parts) > 1 else parts


def is_expert_stack(name: str | None, ndim: int) -> bool:
    """True for a stack of expert matrices: a 3-D parameter (``[num_experts, out, in]``,
    dim 0 the expert) one of whose modules is named ``experts`` (``layers.0.moe.experts.w1``,
    ``model.layers.0.mlp.experts.gate_up_proj``). Without a name, False."""
    return ndim == 3 and bool(name) and EXPERT_MODULE in _modules(name)


def use_muon_for(name: str | None, ndim: int) -> bool:
    """The rule on a parameter's name and number of dimensions (the planner has no tensor).

    2-D parameters use Muon unless a module in the name contains "embed", is one of
    ``wte``/``wpe``/``lm_head``, or is a top-level ``output``/``head``/``classifier``/``score``.
    A stack of expert matrices (``is_expert_stack``) uses Muon, one matrix per expert.
    Everything else uses AdamW. Without a name, a 2-D parameter uses Muon.
    """
    if ndim == 3:
        return is_expert_stack(name, ndim) and not _embedding_or_head(_modules(name))
    if ndim != 2:
        return False
    if not name:
        return True
    return not _embedding_or_head(_modules(name))


def _embedding_or_head(modules: list[str]) -> bool:
    if any("embed" in p or p in _EMBEDDING_PARTS for p in modules):
        return True
    return len(modules) == 1 and modules[0] in _TOP_LEVEL_HEADS
