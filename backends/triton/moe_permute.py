"""MoE dispatch and combine in Triton: ``moe_permute`` and ``moe_unpermute`` (semantics: ``reference.moe_permute``,
``reference.moe_unpermute``).

The expert order itself is a stable ``torch.argsort`` (as the reference); the kernels move the rows. Every
token has exactly ``k`` copies, so each backward is a gather through the inverse permutation instead of a
scatter-add: deterministic, no atomics. fp32 math, outputs in the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_D = 128


@triton.jit
def _gather_rows(X, src, scale, Y, D, sx, sy, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """``Y[i] = X[src[i]] (* scale[i])``."""
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    row = tl.load(src + i).to(tl.int64)
    v = tl.load(X + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        v = v * tl.load(scale + i).to(tl.float32)
    tl.store(Y + i * sy + cols, v.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _gather_sum(X, idx, w, Y, D, K, sx, sy, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    """``Y[t] = sum_j (w[t*K+j] *) X[idx[t*K+j]]``."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(K):
        row = tl.load(idx + t * K + j).to(tl.int64)
        v = tl.load(X + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            v = v * tl.load(w + t * K + j).to(tl.float32)
        acc += v
    tl.store(Y + t * sy + cols, acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _row_dots(P, idx, G, DW, D, K, sp, sg, BLOCK: tl.constexpr):
    """``DW[t*K+j] = <P[idx[t*K+j]], G[t]>`` (the combine weights' gradient)."""
    s = tl.program_id(0).to(tl.int64)
    t = s // K
    row = tl.load(idx + s).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK):
        cols = d0 + tl.arange(0, BLOCK)
        mask = cols < D
        p = tl.load(P + row * sp + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + t * sg + cols, mask=mask, other=0.0).to(tl.float32)
        acc += p * g
    tl.store(DW + s, tl.sum(acc, axis=0).to(DW.dtype.element_ty))


def _grid(rows: int, d: int) -> tuple[int, int]:
    return rows, triton.cdiv(d, BLOCK_D)


def _gather(x: torch.Tensor, src: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    y = x.new_empty((src.numel(), x.shape[1]))
    if y.numel():
        _gather_rows[_grid(src.numel(), x.shape[1])](x, src, scale if scale is not None else src, y, x.shape[1],
                                                    x.stride(0), y.stride(0), HAS_SCALE=scale is not None,
                                                    BLOCK=BLOCK_D)
    return y


def _sum_k(x: torch.Tensor, idx: torch.Tensor, n: int, k: int, w: torch.Tensor | None = None) -> torch.Tensor:
    y = x.new_empty((n, x.shape[1]))
    if y.numel():
        _gather_sum[_grid(n, x.shape[1])](x, idx, w if w is not None else idx, y, x.shape[1], k, x.stride(0),
                                          y.stride(0), HAS_W=w is not None, BLOCK=BLOCK_D)
    return y


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return inv


class Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens: torch.Tensor, src: torch.Tensor, order: torch.Tensor, k: int):  # type: ignore[override]
        ctx.save_for_backward(order)
        ctx.n, ctx.k = tokens.shape[0], k
        return _gather(tokens.contiguous(), src)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (order,) = ctx.saved_tensors
        return _sum_k(grad.contiguous(), _inverse(order), ctx.n, ctx.k), None, None, None


def moe_permute(tokens: torch.Tensor, expert_ids: torch.Tensor, num_experts: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    k = expert_ids.shape[-1] if expert_ids.dim() > 1 else 1
    counts = torch.bincount(flat, minlength=num_experts)
    return Permute.apply(tokens, order // k, order, k), order, counts


class Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, permuted: torch.Tensor, order: torch.Tensor,  # type: ignore[override]
                weights: torch.Tensor) -> torch.Tensor:
        n, k = weights.shape
        permuted = permuted.contiguous()
        w = weights.to(permuted.dtype).contiguous().reshape(-1)
        inv = _inverse(order)
        ctx.save_for_backward(permuted, order, inv, w)
        ctx.k, ctx.weights_dtype = k, weights.dtype
        return _sum_k(permuted, inv, n, k, w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        permuted, order, inv, w = ctx.saved_tensors
        grad = grad.contiguous()
        d_perm = d_w = None
        if ctx.needs_input_grad[0]:
            d_perm = _gather(grad, order // ctx.k, w[order])
        if ctx.needs_input_grad[2]:
            d_w = torch.empty(w.numel(), dtype=torch.float32, device=w.device)
            if d_w.numel():
                _row_dots[(w.numel(),)](permuted, inv, grad, d_w, permuted.shape[1], ctx.k, permuted.stride(0),
                                        grad.stride(0), BLOCK=BLOCK_D)
            d_w = d_w.view(-1, ctx.k).to(ctx.weights_dtype)
        return d_perm, None, d_w


def moe_unpermute(permuted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return Unpermute.apply(permuted, order, weights)
