"""SwiGLU ``silu(gate) * up`` forward and backward in Triton (semantics: ``reference.swiglu``).

Elementwise over the flattened tensors; fp32 math, output in ``gate.dtype``. The backward recomputes
``sigmoid(gate)`` instead of saving activations.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from crosstrain.backends.triton.launch import Launcher, make_configs


@triton.jit
def _swiglu_fwd(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    silu = g * s
    dsilu = s * (1.0 + g * (1.0 - s))
    tl.store(DG + offs, (dy * u * dsilu).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, (dy * silu).to(DU.dtype.element_ty), mask=mask)


def _configs() -> list:
    return make_configs([256, 512], [{"BLOCK": 1024}, {"BLOCK": 2048}, {"BLOCK": 4096}])


_fwd = Launcher(_swiglu_fwd, _configs, key=["n"])
_bwd = Launcher(_swiglu_bwd, _configs, key=["n"])


def _grid(n: int):
    return lambda meta: (triton.cdiv(n, meta["BLOCK"]),)


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        y = torch.empty_like(gate)
        n = gate.numel()
        if n:
            _fwd[_grid(n)](gate, up, y, n)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        dg = torch.empty_like(gate)
        du = torch.empty_like(up)
        n = gate.numel()
        if n:
            _bwd[_grid(n)](dy, gate, up, dg, du, n)
        return dg, du


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return SwiGLUFunction.apply(gate, up)
