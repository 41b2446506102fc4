"""AdamW's arithmetic, op for op as ``torch.optim.AdamW`` in torch 2.13 on CPU.

On CPU, torch picks neither the foreach nor the fused path by default (foreach kernels
are listed for cuda/xpu/mtia only), so AdamW runs ``_single_tensor_adam`` with
``decoupled_weight_decay=True``. This is that sequence, with the ``denom`` temporary
written into a caller's buffer. Every op is elementwise, so a parameter may be updated in
pieces (one per store bucket) and still match the whole-tensor update bit for bit.
"""

from __future__ import annotations

import torch


def adamw_update_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                  exp_avg_sq: torch.Tensor, max_exp_avg_sq: torch.Tensor | None, denom: torch.Tensor,
                  *, step: float, lr: float, beta1: float, beta2: float, eps: float,
                  weight_decay: float, amsgrad: bool, maximize: bool) -> None:
    """One AdamW step on flat pieces of equal length; ``step`` is already incremented.

    ``denom`` is scratch of the same length and dtype (overwritten).
    """
    if maximize:
        grad = -grad
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2 ** 0.5
    if amsgrad:
        torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        torch.sqrt(max_exp_avg_sq, out=denom)
    else:
        torch.sqrt(exp_avg_sq, out=denom)
    denom.div_(bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
