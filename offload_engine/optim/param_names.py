"""Names and module kinds for parameters handed over without names.

``model.parameters()`` and the group dicts the Hugging Face Trainer and torchtitan build
carry tensors only, so the name rule (``param_rules``) cannot see that a 2-D tensor is an
embedding table or an output head, and would put it on Muon. Given the model, each tensor
gets its name from ``model.named_parameters()`` (by identity), and the parameters of
embedding modules, and of the model's input and output embeddings where it declares them
(Hugging Face's ``get_input_embeddings`` / ``get_output_embeddings``), are marked as
embeddings whatever their names.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from ..errors import InputError


def embedding_param_ids(model: nn.Module) -> set[int]:
    """``id`` of every parameter that is an embedding table or an output head by module:
    ``nn.Embedding`` / ``nn.EmbeddingBag`` anywhere, and what the model returns from
    ``get_input_embeddings()`` / ``get_output_embeddings()`` when it has them."""
    modules = [m for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        fn = getattr(model, getter, None)
        if callable(fn):
            try:
                found = fn()
            except (NotImplementedError, AttributeError):
                found = None
            if isinstance(found, nn.Module):
                modules.append(found)
    return {id(p) for m in modules for p in m.parameters(recurse=False)}


def name_params(params, model: nn.Module | None):
    """``params`` (tensors, pairs or group dicts) with every bare tensor given its name in
    ``model`` as a ``(name, tensor)`` pair; unchanged without a model. A tensor the model
    does not hold is an error: it cannot be the model's parameter."""
    if model is None:
        return params
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}

    def named(item):
        if isinstance(item, tuple):
            return item
        if id(item) not in names:
            raise InputError(f"a parameter of shape {list(item.shape)} passed to ZeroMuon is "
                             f"not a parameter of the model given as model=")
        return (names[id(item)], item)

    items = list(params) if not isinstance(params, torch.Tensor) else params
    if isinstance(items, list) and items and isinstance(items[0], dict):
        out = []
        for g in items:
            plist = g["params"]
            plist = [plist] if isinstance(plist, torch.Tensor) else list(plist)
            out.append({**g, "params": [named(p) for p in plist]})
        return out
    return [named(p) for p in items] if isinstance(items, list) else items


def module_aware(rule, model: nn.Module | None):
    """``rule`` that also sends a model's embedding and output-head parameters (by module,
    ``embedding_param_ids``) to AdamW, and warns once when it has to decide a 2-D parameter
    without a name (by shape alone)."""
    embeddings = embedding_param_ids(model) if model is not None else set()
    unnamed = []

    def decide(name, param) -> bool:
        if id(param) in embeddings:
            return False
        if name is None and param.ndim == 2:
            unnamed.append(tuple(param.shape))
        return rule(name, param)

    def report() -> None:
        if unnamed:
            warnings.warn(
                f"ZeroMuon: {len(unnamed)} 2-D parameter(s) without names (first "
                f"{list(unnamed[0])}) were put on Muon by shape alone; an embedding or output "
                f"head among them belongs on AdamW. Pass model.named_parameters(), or "
                f"model=model with the parameters or groups", stacklevel=3)
    return decide, report
