"""Muon's arithmetic, op for op as ``torch.optim.Muon`` in torch 2.13, without allocations.

Pure functions over tensors (no store, no communication). Every op is the one torch uses,
on the same memory layout, so results are bitwise equal on CPU:

- momentum: ``M.lerp_(g, 1 - mu)``; Nesterov input ``U = g.lerp(M, mu)`` (else ``U = M``).
  Both are elementwise, so applying them to any split of a tensor gives the same bits.
- Newton-Schulz: ``X = U`` cast to bf16 (always a copy: torch's ``.bfloat16()`` aliases a
  bf16 input and then normalizes the momentum in place, pytorch#194664), transposed when
  rows > cols, ``X.div_(X.norm().clamp(min=eps))``, then per step ``G = X @ X.T``,
  ``H = addmm(G, G, G, beta=b, alpha=c)``, ``X = addmm(X, H, X, beta=a)``, transposed back.
- update: ``p.mul_(1 - lr * wd)`` with the plain lr, then ``p.add_(O, alpha=-lr')`` with lr'
  from the full (global) shape.
"""

from __future__ import annotations

import math

import torch

from .muon_defaults import ADJUST_LR_FNS, DEFAULT_EPS, DEFAULT_NS_COEFFICIENTS, DEFAULT_NS_STEPS
from ..errors import InputError


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape) -> float:
    """The lr applied to the orthogonalized update of a parameter of global ``shape``."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        raise InputError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")
    return lr * ratio


def momentum_update_(buf: torch.Tensor, grad: torch.Tensor, momentum: float) -> None:
    """``buf <- momentum * buf + (1 - momentum) * grad`` (torch's lerp form)."""
    buf.lerp_(grad, 1 - momentum)


def nesterov_input(grad: torch.Tensor, buf: torch.Tensor, momentum: float, nesterov: bool,
                   out: torch.Tensor) -> torch.Tensor:
    """The Newton-Schulz input U: ``grad.lerp(buf, momentum)`` into ``out``, or ``buf`` itself."""
    if not nesterov:
        return buf
    return torch.lerp(grad, buf, momentum, out=out)


def apply_update_(param: torch.Tensor, update: torch.Tensor, lr: float, weight_decay: float,
                  lr_adjusted: float) -> None:
    """Decoupled decay with the plain lr, then the orthogonalized step with the adjusted one."""
    param.mul_(1 - lr * weight_decay)
    param.add_(update, alpha=-lr_adjusted)


class NewtonSchulz:
    """Newton-Schulz on preallocated bf16 buffers, sized once for the largest matrix.

    ``input(rows, cols)`` gives the (rows, cols) bf16 view to fill with U; ``run`` then
    orthogonalizes it and returns O as a (rows, cols) view (valid until the next ``input``).
    """

    def __init__(self, max_numel: int, max_min_dim: int, device: torch.device | str = "cpu"):
        self.max_numel = max_numel
        self.max_min_dim = max_min_dim
        bf16 = torch.bfloat16
        self._x = torch.empty(max(max_numel, 1), dtype=bf16, device=device)
        self._y = torch.empty(max(max_numel, 1), dtype=bf16, device=device)
        self._gram = torch.empty(max(max_min_dim ** 2, 1), dtype=bf16, device=device)
        self._upd = torch.empty(max(max_min_dim ** 2, 1), dtype=bf16, device=device)
        self.calls = 0

    def input(self, rows: int, cols: int) -> torch.Tensor:
        if rows * cols > self.max_numel or min(rows, cols) > self.max_min_dim:
            raise InputError(f"a {rows}x{cols} matrix does not fit the Newton-Schulz workspace "
                             f"({self.max_numel} elements, min dim {self.max_min_dim})")
        return self._x[:rows * cols].view(rows, cols)

    def run(self, rows: int, cols: int, ns_coefficients, ns_steps: int, eps: float) -> torch.Tensor:
        if ns_steps >= 100:
            raise InputError("Number of steps must be less than 100 for computational efficiency")
        a, b, c = ns_coefficients
        tall = rows > cols
        x = self._x[:rows * cols].view(rows, cols)
        if tall:
            x = x.T
        x.div_(x.norm().clamp(min=eps))
        m, n = x.shape
        gram = self._gram[:m * m].view(m, m)
        upd = self._upd[:m * m].view(m, m)
        # ping-pong: step i writes into y, then x, ... (addmm cannot write over its input)
        targets = (self._y[:m * n].view(m, n), self._x[:m * n].view(m, n))
        for i in range(ns_steps):
            torch.mm(x, x.T, out=gram)
            torch.addmm(gram, gram, gram, beta=b, alpha=c, out=upd)
            out = targets[i % 2]
            torch.addmm(x, upd, x, beta=a, out=out)
            x = out
        self.calls += 1
        return x.T if tall else x
