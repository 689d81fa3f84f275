"""Normalised queries and keys (QK-norm: Dehghani et al. 2023, "Scaling Vision Transformers to 22 Billion
Parameters", sec. 2, here with RMSNorm) as two Hugging Face families apply it, and their tensor-parallel styles.

- :class:`HeadNorm`: Qwen3's ``q_norm``/``k_norm``, RMSNorm of each head over ``head_dim`` with one weight shared by
  all heads (transformers ``Qwen3RMSNorm(head_dim)`` on ``[B, T, H, D]``).
- :class:`ProjectionNorm`: OLMo 2's, RMSNorm over the whole q (or k) projection, all heads at once
  (``Olmo2RMSNorm(num_heads * head_dim)`` before the view into heads).

Under tensor parallelism each rank holds only its heads (the projections are column-parallel), so both need the tp
group: HeadNorm's weight is a replicated DTensor whose gradient is summed over the ranks (each rank's covers only its
heads); ProjectionNorm's weight is sharded like the projection's columns and the mean square is all-reduced before
normalising, which gives one process's numbers exactly (tests/test_hf_families.py, logits and gradients).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from crosstrain import kernels
from crosstrain.parallel.tp_autograd import all_reduce_sum, copy_to_tp


class _Norm(nn.Module):
    """``plus_one``: the scale is ``1 + weight``, ``weight`` starting at 0 (Gemma 3's q/k norms)."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.plus_one = plus_one
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))

    def reset_parameters(self) -> None:
        (nn.init.zeros_ if self.plus_one else nn.init.ones_)(self.weight)


class HeadNorm(_Norm):
    """``x / sqrt(mean(x^2 over head_dim) + eps) * w`` for each head of ``x [B, T, H, head_dim]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        weight = self.weight
        if isinstance(weight, DTensor):  # tp: the gradient of the shared weight is summed over the ranks' heads
            weight = copy_to_tp(weight.to_local(), weight.device_mesh.get_group())
        return kernels.rms_norm(x, weight + 1.0 if self.plus_one else weight, self.eps)


class ProjectionNorm(_Norm):
    """``x / sqrt(mean(x^2 over all heads' channels) + eps) * w`` for ``x [B, T, heads * head_dim]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if not isinstance(self.weight, DTensor):
            return kernels.rms_norm(x, self.weight, self.eps)
        # tp: x holds this rank's columns; the mean is over the full projection (self.weight.shape[0] channels)
        weight = self.weight.to_local()
        xf = x.float()
        square_sum = all_reduce_sum(xf.pow(2).sum(dim=-1, keepdim=True), self.weight.device_mesh.get_group())
        out = xf * torch.rsqrt(square_sum / self.weight.shape[0] + self.eps)
        return (out * weight.float()).to(x.dtype)


def _weight_style(placement: Any) -> Any:
    """A tp ``ParallelStyle`` that turns the module's ``weight`` into a DTensor with ``placement`` on the tp mesh."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    class WeightStyle(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            weight = cast(nn.Parameter, module.weight)
            module.weight = nn.Parameter(distribute_tensor(weight.data, device_mesh, [placement]),
                                         requires_grad=weight.requires_grad)
            return module

    return WeightStyle()


def head_norm_style() -> Any:
    """The tp style of :class:`HeadNorm`: its weight replicated."""
    from torch.distributed.tensor import Replicate

    return _weight_style(Replicate())


def projection_norm_style() -> Any:
    """The tp style of :class:`ProjectionNorm`: its weight sharded on dim 0, like the projection's columns."""
    from torch.distributed.tensor import Shard

    return _weight_style(Shard(0))
