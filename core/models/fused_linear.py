"""Linear projections with the additions around them done inside their GEMMs (``beta = 1``), as Megatron-LM fuses
weight-gradient accumulation into its GEMMs (``gradient_accumulation_fusion``): the additions ride on the GEMM's
write of its output instead of a separate pass over ``[tokens, dim]``.

- :func:`project`: linears that read one input (q/k/v, gate/up). Autograd computes ``dx = dy_i @ W_i`` for each and
  adds them (two adds for q/k/v, one for gate/up, in every block); here ``dx`` accumulates with ``addmm_``. Outputs
  and weight gradients are ``F.linear``'s bit for bit (the same GEMMs).
- :func:`residual_linear`: ``residual + linear(x)`` (the output projections ``wo``, ``w2``) as one ``addmm``; the
  residual's gradient passes through untouched.

The parameters stay the modules' own, so state dicts, tensor-parallel plans and exports are unchanged. Anything the
plain call would treat differently (biases, hooks, parametrized or subclassed linears, DTensors, autocast,
``torch.compile`` tracing, no grad) takes the plain ``nn.Linear`` calls.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.nn.modules import module as _module


class _SharedInputLinears(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rows = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x, *weights)
        return tuple(torch.mm(rows, w.t()).view(*x.shape[:-1], w.shape[0]) for w in weights)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        rows = x.reshape(-1, x.shape[-1])
        dx: torch.Tensor | None = None
        dws: list[torch.Tensor | None] = []
        for i, (g, w) in enumerate(zip(grads, weights, strict=True)):
            if g is None:
                dws.append(None)
                continue
            g2 = g.reshape(-1, g.shape[-1])
            if ctx.needs_input_grad[0]:
                dx = torch.mm(g2, w) if dx is None else dx.addmm_(g2, w)
            dws.append(g2.t().mm(rows) if ctx.needs_input_grad[1 + i] else None)
        if dx is not None:
            dx = dx.view(x.shape)
        elif ctx.needs_input_grad[0]:
            dx = torch.zeros_like(x)
        return (dx, *dws)


def hookless(module: nn.Module) -> bool:
    """Whether calling ``module``'s computation directly skips nothing ``module(...)`` would run: no hooks of its
    own, and no global module hooks."""
    return not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or _module._global_forward_hooks or _module._global_forward_pre_hooks
                or _module._global_backward_hooks or _module._global_backward_pre_hooks)


def _plain(linear: nn.Module) -> bool:
    return (type(linear) is nn.Linear and linear.bias is None and type(linear.weight) is nn.Parameter
            and hookless(linear))


def fusable(x: torch.Tensor, linears: tuple[nn.Module, ...]) -> bool:
    """Whether :func:`project` fuses ``linears`` on ``x`` (else it calls them one by one)."""
    return (type(x) is torch.Tensor and torch.is_grad_enabled() and all(_plain(m) for m in linears)
            and all(m.weight.dtype == x.dtype and m.weight.device == x.device for m in linears)
            and not torch.is_autocast_enabled(x.device.type) and not torch.compiler.is_compiling())


def project(x: torch.Tensor, linears: tuple[nn.Module, ...]) -> tuple[torch.Tensor, ...]:
    """``tuple(m(x) for m in linears)``, with the input gradient summed in the GEMMs when :func:`fusable`."""
    if not fusable(x, linears):
        return tuple(m(x) for m in linears)
    return _SharedInputLinears.apply(x, *(m.weight for m in linears))


class _ResidualLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x, weight)
        out = torch.addmm(residual.reshape(-1, residual.shape[-1]), rows, weight.t())
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        dx = torch.mm(g2, weight).view(x.shape) if ctx.needs_input_grad[1] else None
        dw = g2.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[2] else None
        return g if ctx.needs_input_grad[0] else None, dx, dw


def residual_linear(residual: torch.Tensor, x: torch.Tensor, linear: nn.Module) -> torch.Tensor:
    """``residual + linear(x)``, the addition done by the GEMM when :func:`fusable` (and ``residual`` has the
    output's shape and dtype)."""
    # fusable first: it admits plain nn.Linear only, so a module swapped in for it (one without .weight) is called
    if not fusable(x, (linear,)):
        return residual + linear(x)
    weight = cast(torch.Tensor, linear.weight)
    if not (type(residual) is torch.Tensor and residual.dtype == x.dtype
            and residual.shape == (*x.shape[:-1], weight.shape[0])):
        return residual + linear(x)
    return _ResidualLinear.apply(residual, x, weight)
