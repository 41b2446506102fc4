"""One figure of per-layer L2 norms of the parameters and of every optimizer state.

matplotlib is an optional extra (``pip install 'offload-engine[plot]'``); without it,
``--plot`` is refused with a one-line error. Layers are in the model's order
(``model_order``); the y axis is logarithmic.
"""

from __future__ import annotations

import math

from ..formats.errors import FormatError
from .health import layer_of


def layer_norms(stats: dict, order: list[str]) -> tuple[list[str], dict[str, list[float]]]:
    """(layers in order, {state: [L2 norm per layer, NaN where absent]}) of the keys in
    ``stats``; layers follow ``order`` (tensor names) and hold at least one key."""
    names = {name for name, _ in stats}
    order = model_order([n for n in order if n in names])
    layers: list[str] = []
    seen = set()
    for name in order:
        layer = layer_of(name)
        if layer not in seen:
            seen.add(layer)
            layers.append(layer)
    index = {layer: i for i, layer in enumerate(layers)}
    sums: dict[str, list[float]] = {}
    for (name, state), s in stats.items():
        row = sums.setdefault(state, [math.nan] * len(layers))
        i = index[layer_of(name)]
        row[i] = (0.0 if math.isnan(row[i]) else row[i]) + s["sumsq"]
    return layers, {state: [math.sqrt(v) if not math.isnan(v) else math.nan for v in row]
                    for state, row in sums.items()}


def model_order(names: list[str]) -> list[str]:
    """``names`` (as a manifest lists them) in the model's order, where that is seen.

    A ZeroMuon checkpoint lists its tensors by optimizer group: the Muon matrices, then the
    AdamW tensors (embedding, norms, head), each group in model order. Without this the
    embedding was plotted after the last layer. Where one numbered stack (``layers.N``)
    runs through both groups, the groups are merged on its numbers: a name before a
    group's first numbered one (an embedding) goes before that number, one after a group's
    last (a final norm, the head) after it. Names with several numbered stacks, or none,
    keep their order."""
    numbers = [_layer_number(n) for n in names]
    if len({p for p, _ in filter(None, numbers)}) != 1:
        return list(names)
    keys = []
    for i, num in enumerate(numbers):
        if num is not None:
            keys.append(num[1])
            continue
        before = next((numbers[j][1] for j in range(i - 1, -1, -1) if numbers[j]), None)
        after = next((numbers[j][1] for j in range(i + 1, len(names)) if numbers[j]), None)
        if after is not None and (before is None or after < before):
            keys.append(after - 0.5)   # opens a group: before its first numbered layer
        else:
            keys.append(before + 0.5)  # closes a group: after its last
    return [n for _, _, n in sorted(zip(keys, range(len(names)), names))]


def _layer_number(name: str) -> tuple[str, int] | None:
    """(stack, number) of a name in a numbered stack (``layers.3.w`` -> ("layers", 3))."""
    layer = layer_of(name)
    stack, _, number = layer.rpartition(".")
    return (stack, int(number)) if number.isdigit() else None


def plot_layer_norms(stats: dict, order: list[str], out_path: str, title: str,
                     floating: set | None = None) -> None:
    """Draw ``stats`` ({(tensor, state): stats}) into ``out_path``; only the keys in
    ``floating`` when given (an integer step counter or a boolean mask is no norm to plot)."""
    try:
        import matplotlib
    except ImportError:
        raise FormatError("--plot needs matplotlib (pip install 'offload-engine[plot]' or "
                           "pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if floating is not None:
        stats = {k: v for k, v in stats.items() if k in floating}
    layers, norms = layer_norms(stats, order)
    fig, ax = plt.subplots(figsize=(max(6.0, min(24.0, 0.35 * len(layers) + 4)), 4.5))
    x = list(range(len(layers)))
    for state in sorted(norms):
        ax.plot(x, norms[state], marker="o", markersize=3, label=state)
    ax.set_yscale("log")
    ax.set_ylabel("L2 norm")
    ax.set_xlabel("layer")
    step = max(1, len(layers) // 40)
    ax.set_xticks(x[::step])
    ax.set_xticklabels(layers[::step], rotation=60, ha="right", fontsize=7)
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(out_path, dpi=120)
    except OSError as e:
        raise FormatError(f"{out_path}: cannot write the figure ({e})") from None
    finally:
        plt.close(fig)
