"""The three autograd-aware collectives of Megatron-style tensor parallelism (Shoeybi et al. 2019, "Megatron-LM",
sec. 3, its ``f`` and ``g`` operators), for modules that work on a rank's slice of heads, channels or vocabulary:

- :func:`copy_to_tp` (``f``): identity forward; the backward sums the gradient over the group (each rank computed it
  through its own slice only).
- :func:`reduce_from_tp` (``g``): sum over the group forward; identity backward (every rank then uses the same value,
  so each back-propagates the common loss into its own slice once).
- :func:`all_reduce_sum`: sum forward and backward (each rank's output depends on every rank's input, and each rank's
  loss on every rank's output).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron's ``f``: ``x`` forward, gradient summed over ``group`` backward."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron's ``g``: ``x`` summed over ``group`` forward, gradient passed through backward."""
    return _ReduceFromTP.apply(x, group)


def all_reduce_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` summed over ``group``, forward and backward."""
    return _AllReduceSum.apply(x, group)
