"""Rotary embedding (rotate-half) forward and backward in Triton (semantics: ``reference.rotary_embedding``).

``x`` is ``[..., T, H, D]`` (contiguous), ``cos``/``sin`` are ``[T, D/2]``. One program handles one ``(…, t)``
row and a block of heads, loading ``cos``/``sin`` for ``t`` once. The backward is the same rotation by
``-sin`` (the rotation is orthogonal), so one kernel serves both directions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from crosstrain.backends.triton.launch import Launcher, make_configs


@triton.jit
def _rotary(X, COS, SIN, Y, T, H, HALF, sign, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    hb = tl.program_id(1)
    t = row % T
    d = tl.arange(0, BLOCK_D)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    dmask = d < HALF
    c = tl.load(COS + t * HALF + d, mask=dmask, other=0.0).to(tl.float32)
    s = tl.load(SIN + t * HALF + d, mask=dmask, other=0.0).to(tl.float32) * sign
    mask = (h[:, None] < H) & dmask[None, :]
    base = row.to(tl.int64) * H * 2 * HALF
    offs = base + h[:, None] * (2 * HALF) + d[None, :]
    x1 = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * c[None, :] - x2 * s[None, :]
    y2 = x2 * c[None, :] + x1 * s[None, :]
    tl.store(Y + offs, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + offs + HALF, y2.to(Y.dtype.element_ty), mask=mask)


def _configs() -> list:
    return make_configs([64, 128, 256])


_launch = Launcher(_rotary, _configs, key=["H", "HALF"])


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    t, h, d = x.shape[-3], x.shape[-2], x.shape[-1]
    half = d // 2
    y = torch.empty_like(x)
    rows = x.numel() // (h * d) if h * d else 0
    if rows == 0:
        return y
    block_d = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(h), max(1, 4096 // block_d))
    grid = (rows, triton.cdiv(h, block_h))
    _launch[grid](x, cos, sin, y, t, h, half, sign, BLOCK_H=block_h, BLOCK_D=block_d)
    return y


class RotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        cos = cos.contiguous()
        sin = sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _apply(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return _apply(dy.contiguous(), cos, sin, -1.0), None, None


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return RotaryFunction.apply(x, cos, sin)
