"""Optimizer health from per-tensor statistics: what to look at after a run went wrong.

- momentum RMS per layer (Muon ``momentum_buffer``, Adam ``exp_avg``): a layer far above
  the others is where updates blew up;
- Adam's second moment range (``exp_avg_sq`` min and max): a tiny v means epsilon
  dominates the update, a huge one a gradient spike;
- the largest absolute values and which tensor holds them;
- the layers and tensors holding NaN or Inf.

A *layer* is the name up to its first numeric component (``model.layers.3.mlp.w1.weight``
-> ``model.layers.3``), else the module path (``emb.weight`` -> ``emb``).
"""

from __future__ import annotations

import math
import re

MOMENTUM_STATES = ("momentum_buffer", "exp_avg")
_NUMBERED = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def layer_of(name: str) -> str:
    m = _NUMBERED.match(name)
    if m:
        return m.group(1)
    return name.rsplit(".", 1)[0] if "." in name else name


def health_summary(stats: dict, top: int = 5, floating: set | None = None) -> dict:
    """``stats``: {(tensor, state): stats dict} as ``collect_stats`` returns; ``floating``:
    the keys of floating-point states (the largest values are looked for among those
    only, so an integer step counter does not top the list); None: all keys."""
    layers: dict[tuple[str, str], list[float]] = {}
    vmin = vmax = None
    largest = []
    nonfinite = []
    for (name, state), s in stats.items():
        finite = s["count"] - s["nan"] - s["inf"]
        if state in MOMENTUM_STATES and finite:
            acc = layers.setdefault((layer_of(name), state), [0.0, 0])
            acc[0] += s["sumsq"]
            acc[1] += finite
        if state == "exp_avg_sq" and finite:
            if vmin is None or s["min"] < vmin["value"]:
                vmin = {"value": s["min"], "tensor": name}
            if vmax is None or s["max"] > vmax["value"]:
                vmax = {"value": s["max"], "tensor": name}
        if finite and (floating is None or (name, state) in floating):
            largest.append({"tensor": name, "state": state,
                            "abs_max": max(abs(s["min"]), abs(s["max"]))})
        if s["nan"] or s["inf"]:
            nonfinite.append({"tensor": name, "state": state, "layer": layer_of(name),
                              "nan": s["nan"], "inf": s["inf"]})
    largest.sort(key=lambda e: -e["abs_max"])
    return {
        "momentum_rms_per_layer": [
            {"layer": layer, "state": state, "rms": math.sqrt(sq / n)}
            for (layer, state), (sq, n) in layers.items()],
        "adam_exp_avg_sq": {"min": vmin, "max": vmax} if vmin else None,
        "largest_values": largest[:top],
        "nonfinite": nonfinite,
        "nonfinite_layers": sorted({e["layer"] for e in nonfinite}),
    }
