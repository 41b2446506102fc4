"""Which parameters Muon updates: the one rule the optimizer, the planner and the CLI share.

Muon orthogonalizes hidden-layer matrices. Everything else goes to AdamW: parameters that
are not 2-D (biases, norm gains, scalars, conv filters) and 2-D parameters whose name marks
an embedding table or an output head (their rows are per-token vectors, not a linear map
between hidden spaces). This is the recipe of the Muon and Moonlight authors.
"""

from __future__ import annotations

# module names that hold an embedding table wherever they sit in the model
_EMBEDDING_PARTS = ("wte", "wpe", "lm_head")
# module names that are an output head when they sit at the top of the model ("output.weight"
# in Llama checkpoints); deeper down, "output" is an ordinary projection (BERT's layer.N.output)
_TOP_LEVEL_HEADS = ("output", "head", "classifier", "score")
# prefixes that wrappers add in front of the user's own names
_WRAPPER_PARTS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "module")


def default_use_muon(name: str | None, param) -> bool:
    """True when ``param`` (a tensor named ``name`` as in ``model.named_parameters()``) should
    use Muon: ``use_muon_for(name, param.ndim)``. For an FSDP2 DTensor, ``param.ndim`` is
    that of the full tensor."""
    return use_muon_for(name, param.ndim)


def use_muon_for(name: str | None, ndim: int) -> bool:
    """The rule on a parameter's name and number of dimensions (the planner has no tensor).

    2-D parameters use Muon unless a module in the name contains "embed", is one of
    ``wte``/``wpe``/``lm_head``, or is a top-level ``output``/``head``/``classifier``/``score``.
    Everything that is not 2-D uses AdamW. Without a name, a 2-D parameter uses Muon.
    """
    if ndim != 2:
        return False
    if not name:
        return True
    parts = name.lower().split(".")
    while len(parts) > 1 and parts[0] in _WRAPPER_PARTS:
        parts = parts[1:]
    modules = parts[:-1] if len(parts) > 1 else parts
    if any("embed" in p or p in _EMBEDDING_PARTS for p in modules):
        return False
    if len(modules) == 1 and modules[0] in _TOP_LEVEL_HEADS:
        return False
    return True
