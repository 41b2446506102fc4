"""What the DeepSpeed reader takes from a model states file (``*_model_states.pt``): the
parameter shapes, buffer names and tied names, each checked, and the file trimmed to what
is read of it.

Under ZeRO-3 every rank's file holds, in ``module``, an empty placeholder tensor per
parameter: 100,000 of them for a mixture-of-experts model, each a few objects once
unpickled. ``trimmed`` drops them (and rank > 0's copy of the shapes) as soon as a file is
loaded, so the reader holds one file's worth of them at a time, and none afterwards.
"""

from __future__ import annotations

from ..pt_limits import MAX_EXTENT, MAX_NDIM
from ..safe_unpickler import PtFile, TensorRef, short_repr
from .files import DeepSpeedLayoutError


def _shape(value, what: str, path: str) -> tuple[int, ...]:
    """A shape recorded in the metadata (``param_shapes``, ``frozen_param_shapes``): at most
    ``pt_limits.MAX_NDIM`` sizes, each an int in [0, 2**63); checked before its product is
    used (the product of 10,000 huge sizes alone takes minutes)."""
    if isinstance(value, (tuple, list)) and len(value) <= MAX_NDIM and all(
            type(d) is int and 0 <= d <= MAX_EXTENT for d in value):
        return tuple(value)
    raise DeepSpeedLayoutError(f"{path}: {what} has shape {short_repr(value)}, expected at most "
                               f"{MAX_NDIM} integers in [0, 2**63)")


def shape_groups(model: PtFile, key: str) -> list[dict[str, tuple[int, ...]]]:
    """``param_shapes`` (one dict, or a list of them: one per param group) or
    ``frozen_param_shapes`` (one dict) as a list of {name: shape}, every shape checked."""
    groups = model.obj.get(key)
    groups = [groups] if isinstance(groups, dict) else groups
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, dict) for g in groups):
        raise DeepSpeedLayoutError(f"{model.path}: '{key}' is {short_repr(groups)}, expected a dict "
                                   f"of parameter shapes or a list of them")
    out = []
    for g in groups:
        if not all(isinstance(n, str) for n in g):
            raise DeepSpeedLayoutError(f"{model.path}: '{key}' has a parameter name that is not a string")
        out.append({n: _shape(s, f"{key}[{n[:200]!r}]", model.path) for n, s in g.items()})
    return out


def buffer_names(model: PtFile) -> list[str]:
    """``buffer_names``: a list of strings (None: no buffers)."""
    names = model.obj.get("buffer_names") or []
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise DeepSpeedLayoutError(f"{model.path}: 'buffer_names' is {short_repr(names)}, "
                                   f"expected a list of names")
    return list(names)


def shared_params(model: PtFile) -> dict[str, str]:
    """``shared_params``: {alias: owner}, both strings (None: no tied parameters)."""
    shared = model.obj.get("shared_params") or {}
    if not isinstance(shared, dict) or not all(
            isinstance(a, str) and isinstance(o, str) for a, o in shared.items()):
        raise DeepSpeedLayoutError(f"{model.path}: 'shared_params' is {short_repr(shared)}, "
                                   f"expected a dict of alias -> owner names")
    return shared


def _storage_keys(obj) -> set[str]:
    """The storage keys of every tensor left in a trimmed file's object (buffers, ZeRO-3
    frozen fragments)."""
    keys = set()
    for part in (obj.get("module"), obj.get("frozen_param_fragments")):
        if isinstance(part, dict):
            keys.update(ref.storage.key for ref in part.values() if isinstance(ref, TensorRef))
    return keys


def trimmed(model: PtFile, rank: int, stage: int) -> PtFile:
    """A model states file, checked, with what the reader never reads of it dropped: under
    ZeRO-3 its ``module`` holds an empty placeholder tensor per parameter (100,000 for a
    mixture-of-experts model), of which only the buffers are read, and the parameter
    shapes are read from rank 0's file alone."""
    obj = model.obj
    if not isinstance(obj, dict) or "param_shapes" not in obj or not isinstance(obj.get("module"), dict):
        raise DeepSpeedLayoutError(f"{model.path}: not a DeepSpeed model states file "
                                   f"(no 'param_shapes' / 'module')")
    if stage == 3:
        module = obj["module"]
        obj["module"] = {n: module[n] for n in buffer_names(model) if n in module}
        if rank > 0:
            obj["param_shapes"] = []
        model.storages.clear()
        model.archive.forget_empty_records(_storage_keys(obj))
    return model
