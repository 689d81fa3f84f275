"""Fake quantisation (quantise, then dequantise, in floating point) with straight-through gradients.

Affine quantisation (Jacob et al. 2018, "Quantization and Training of Neural Networks for Efficient
Integer-Arithmetic-Only Inference", arXiv:1712.05877): ``q = clamp(round(x / s) + z, qmin, qmax)``,
``x_hat = (q - z) * s``. Rounding passes gradients straight through (Bengio et al. 2013, the STE), the clamp
passes them only where ``round(x / s) + z`` lies in ``[qmin, qmax]``; scales and zero points are constants of the
backward pass. The formulas follow torchao's ``IntxFakeQuantizer`` op for op (``x * (1 / s)``, the eps clamps), so
both give bit-identical results (tests/test_qat.py).
"""

from __future__ import annotations

import torch


class _RoundSTE(torch.autograd.Function):
    """``round`` forward, identity backward."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def qrange(bits: int) -> tuple[int, int]:
    """Signed integer range of ``bits`` bits: ``[-2^(b-1), 2^(b-1) - 1]`` (torchao keeps asymmetric int8 signed too)."""
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


@torch.no_grad()
def per_token_qparams(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric per-token (last axis) scale and zero point, fp32 ``[..., 1]``:
    ``s = (max(x_max, 0) - min(x_min, 0)) / (qmax - qmin)`` clamped to fp32 eps,
    ``z = clamp(qmin - round(min / s))``."""
    qmin, qmax = qrange(bits)
    x = x.float()
    lo = torch.clamp(x.amin(-1, keepdim=True), max=0.0)
    hi = torch.clamp(x.amax(-1, keepdim=True), min=0.0)
    scale = torch.clamp((hi - lo) / float(qmax - qmin), min=torch.finfo(torch.float32).eps)
    zero = torch.clamp(qmin - torch.round(lo / scale), qmin, qmax)
    return scale, zero


def fake_quant_per_token(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """Dynamic asymmetric per-token fake quantisation of activations (torchao's 8-bit per-token, ``is_dynamic``)."""
    qmin, qmax = qrange(bits)
    scale, zero = per_token_qparams(x, bits)
    q = torch.clamp(_RoundSTE.apply(x.float() * (1.0 / scale)) + zero, qmin, qmax)
    return ((q - zero) * scale).to(x.dtype)


@torch.no_grad()
def weight_qparams(w: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Symmetric scales ``[out, in / group_size]``: ``s = max|w_group| / ((qmax - qmin) / 2)``, clamped to the
    smallest normal fp32 (torchao's ``get_group_qparams_symmetric``; zero point 0)."""
    qmin, qmax = qrange(bits)
    g = w.float().reshape(w.shape[0], -1, group_size)
    lo = torch.clamp(g.amin(-1), max=0.0)
    hi = torch.clamp(g.amax(-1), min=0.0)
    peak = torch.maximum(-lo, hi)
    return torch.clamp(peak / (float(qmax - qmin) / 2), min=torch.finfo(torch.float32).smallest_normal)


def quantize_weight(w: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer weights (``int8`` tensor holding values in ``[qmin, qmax]``) and their scales ``[out, in / group]``."""
    qmin, qmax = qrange(bits)
    scale = weight_qparams(w, bits, group_size)
    g = w.detach().float().reshape(w.shape[0], -1, group_size)
    q = torch.clamp(torch.round(g * (1.0 / scale.unsqueeze(-1))), qmin, qmax)
    return q.reshape(w.shape).to(torch.int8), scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * s`` per group, fp32, the shape of ``q``."""
    group = q.shape[1] // scale.shape[1]
    return (q.float().reshape(q.shape[0], -1, group) * scale.unsqueeze(-1)).reshape(q.shape)


def fake_quant_weight(w: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Symmetric per-group (``group_size`` = in_features: per-channel) fake quantisation of a ``[out, in]`` weight."""
    qmin, qmax = qrange(bits)
    scale = weight_qparams(w, bits, group_size).unsqueeze(-1)
    g = w.float().reshape(w.shape[0], -1, group_size)
    q = torch.clamp(_RoundSTE.apply(g * (1.0 / scale)), qmin, qmax)
    return (q * scale).reshape(w.shape).to(w.dtype)
