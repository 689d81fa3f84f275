"""Pure-PyTorch reference implementations of the optimizer-step ops ``adamw_step`` and ``sgd_step``.

They define the ops' semantics (kernel registry, :mod:`crosstrain.kernels.reference` ``CORE_OPS``) and run on
any device. Each updates an fp32 (or any floating) master ``param`` in place from ``grad`` of any floating
dtype, updates the state tensors in place and, when ``out`` is given, writes the new parameter into ``out``
in ``out``'s dtype (the low-precision copy a device needs). Arithmetic follows ``torch.optim.AdamW`` /
``torch.optim.SGD`` (single-tensor path) operation by operation, so fp32 results match torch.
"""

from __future__ import annotations

import torch


def adamw_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    max_exp_avg_sq: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool = False,
    grad_scale: float = 1.0,
) -> None:
    """One AdamW update (decoupled weight decay, bias correction; amsgrad when ``max_exp_avg_sq`` is given).

    ``step`` is the step count including this update (1 on the first call); ``grad`` is multiplied by
    ``grad_scale`` (e.g. an inverse loss scale) and negated when ``maximize``.
    """
    g = grad.to(param.dtype)
    if grad_scale != 1.0:
        g = g * grad_scale
    if maximize:
        g = -g
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    if max_exp_avg_sq is not None:
        torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        denom = (max_exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    else:
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    if out is not None:
        out.copy_(param)


def sgd_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    first_step: bool = False,
    maximize: bool = False,
    grad_scale: float = 1.0,
) -> None:
    """One SGD update with optional (nesterov) momentum; ``first_step`` initialises the buffer to the grad."""
    g = grad.to(param.dtype)
    if grad_scale != 1.0:
        g = g * grad_scale
    if maximize:
        g = -g
    if weight_decay != 0:
        g = g.add(param, alpha=weight_decay)
    if momentum != 0:
        if momentum_buffer is None:
            raise ValueError("sgd_step: momentum != 0 needs a momentum_buffer")
        if first_step:
            momentum_buffer.copy_(g)
        else:
            momentum_buffer.mul_(momentum).add_(g, alpha=1 - dampening)
        g = g.add(momentum_buffer, alpha=momentum) if nesterov else momentum_buffer
    param.add_(g, alpha=-lr)
    if out is not None:
        out.copy_(param)
