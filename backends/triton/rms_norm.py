"""RMSNorm forward and backward in Triton (semantics: ``crosstrain.kernels.reference.rms_norm``).

Forward: one program per row, fp32 math, saves ``rstd`` per row. Backward: a persistent grid; each program
walks a contiguous block of rows, writes ``dx`` and accumulates its share of ``dweight`` in fp32 registers, then
stores one partial row; the partials are summed by torch (no atomics, so autotuning is safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from crosstrain.backends.triton.launch import Launcher, make_configs, num_programs

#: widest row handled by the single-pass kernels (wider rows use the reference).
MAX_WIDTH = 16384


@triton.jit
def _rms_fwd(X, W, Y, RSTD, stride, N, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    tl.store(RSTD + row, rstd)
    tl.store(Y + row * stride + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_bwd(DY, X, W, RSTD, DX, DW_PART, stride, M, N, rows_per_program, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in range(0, rows_per_program):
        row = pid * rows_per_program + i
        mask = cols < tl.where(row < M, N, 0)  # rows past M (last program) load nothing
        base = row * stride
        x = tl.load(X + base + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + base + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + tl.minimum(row, M - 1))
        xhat = x * rstd
        g = dy * w
        c = tl.sum(g * xhat, axis=0) / N
        dx = (g - xhat * c) * rstd
        tl.store(DX + base + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(DW_PART + pid * N + cols, dw, mask=cols < N)


def _configs() -> list:
    return make_configs([128, 256, 512, 1024])


_fwd = Launcher(_rms_fwd, _configs, key=["N"])
_bwd = Launcher(_rms_bwd, _configs, key=["N"])


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        shape = x.shape
        n = shape[-1]
        x2 = x.reshape(-1, n)
        m = x2.shape[0]
        y = torch.empty_like(x2)
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(n)
        if m:
            _fwd[(m,)](x2, weight, y, rstd, x2.stride(0), n, eps, BLOCK_N=block)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        x2, weight, rstd = ctx.saved_tensors
        m, n = x2.shape
        dy2 = dy.reshape(-1, n).contiguous()
        dx = torch.empty_like(x2)
        programs = max(1, min(m, num_programs(x2.device)))
        rows_per_program = triton.cdiv(m, programs)
        programs = triton.cdiv(m, rows_per_program)
        part = torch.empty((programs, n), dtype=torch.float32, device=x2.device)
        if m:
            _bwd[(programs,)](
                dy2, x2, weight, rstd, dx, part, x2.stride(0), m, n, rows_per_program,
                BLOCK_N=triton.next_power_of_2(n),
            )
            dw = part.sum(0).to(weight.dtype)
        else:
            dw = torch.zeros_like(weight)
        return dx.view(ctx.shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return RMSNormFunction.apply(x, weight, eps)
