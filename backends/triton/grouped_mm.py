"""Grouped matmul ``out[rows of g] = x[rows of g] @ W[g]`` forward and backward in Triton (semantics:
``reference.grouped_mm``).

Groups are contiguous row ranges (``tokens_per_group``, as ``moe_permute`` returns them). The host turns the
sizes into a tile table once per call (one sync, like the reference's ``tolist``): every program owns
``BLOCK_M`` rows of a single group, so no tile straddles two experts. ``dx = dy @ W[g]^T`` is the same kernel
reading ``W`` through transposed strides; ``dW[g] = x_g^T @ dy_g`` reduces over the group's rows (a group with
no rows gets a zero gradient). fp32 accumulation, output in ``x.dtype``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from crosstrain.backends.triton.launch import interpreting

BLOCK_M, BLOCK_N, BLOCK_K = 32, 32, 32


@triton.jit
def _grouped_mm_kernel(X, W, Y, tile_group, tile_start, tile_end, K, M,
                       sxm, sxk, swg, swk, swn, sym, syn,
                       IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    tile = tl.program_id(0)
    g = tl.load(tile_group + tile).to(tl.int64)
    start = tl.load(tile_start + tile).to(tl.int64)
    end = tl.load(tile_end + tile).to(tl.int64)
    rows = start + tl.arange(0, BM)
    cols = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        a = tl.load(X + rows[:, None] * sxm + ks[None, :] * sxk, mask=(rows[:, None] < end) & (ks[None, :] < K),
                    other=0.0)
        b = tl.load(W + g * swg + ks[:, None] * swk + cols[None, :] * swn,
                    mask=(ks[:, None] < K) & (cols[None, :] < M), other=0.0)
        if IEEE:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    tl.store(Y + rows[:, None] * sym + cols[None, :] * syn, acc.to(Y.dtype.element_ty),
             mask=(rows[:, None] < end) & (cols[None, :] < M))


@triton.jit
def _grouped_wgrad_kernel(X, DY, DW, offsets, K, M, sxm, sxk, sym, syn, swg, swk, swn,
                          IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    ks = tl.program_id(1).to(tl.int64) * BK + tl.arange(0, BK)
    cols = tl.program_id(2).to(tl.int64) * BN + tl.arange(0, BN)
    start = tl.load(offsets + g).to(tl.int64)
    end = tl.load(offsets + g + 1).to(tl.int64)
    acc = tl.zeros((BK, BN), dtype=tl.float32)
    for r0 in range(start, end, BM):
        rows = r0 + tl.arange(0, BM)
        a = tl.load(X + rows[:, None] * sxm + ks[None, :] * sxk, mask=(rows[:, None] < end) & (ks[None, :] < K),
                    other=0.0)
        b = tl.load(DY + rows[:, None] * sym + cols[None, :] * syn,
                    mask=(rows[:, None] < end) & (cols[None, :] < M), other=0.0)
        if IEEE:
            acc += tl.dot(tl.trans(a.to(tl.float32)), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(tl.trans(a), b)
    tl.store(DW + g * swg + ks[:, None] * swk + cols[None, :] * swn, acc.to(DW.dtype.element_ty),
             mask=(ks[:, None] < K) & (cols[None, :] < M))


def _ieee(x: torch.Tensor) -> bool:
    # fp32 inputs: exact fp32 products (no tf32), like the reference; the interpreter (numpy) has no bf16 dot
    return x.dtype == torch.float32 or interpreting()


def _tiles(sizes: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, starts, ends = [], [], []
    offset = 0
    for g, n in enumerate(sizes):
        for s in range(offset, offset + n, BLOCK_M):
            groups.append(g)
            starts.append(s)
            ends.append(offset + n)
        offset += n
    as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    return as_tensor(groups), as_tensor(starts), as_tensor(ends)


def _matmul(x: torch.Tensor, w: torch.Tensor, w_strides: tuple[int, int, int], m: int,
            tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    y = x.new_empty((x.shape[0], m))
    if tiles[0].numel() and m:
        grid = (tiles[0].numel(), triton.cdiv(m, BLOCK_N))
        _grouped_mm_kernel[grid](x, w, y, *tiles, x.shape[1], m, x.stride(0), x.stride(1), *w_strides,
                                 y.stride(0), y.stride(1), IEEE=_ieee(x),
                                 BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K)
    elif m:
        y.zero_()
    return y


class GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weights: torch.Tensor,  # type: ignore[override]
                tokens_per_group: torch.Tensor) -> torch.Tensor:
        sizes = [int(s) for s in tokens_per_group.tolist()]
        if sum(sizes) != x.shape[0] or len(sizes) != weights.shape[0]:
            raise ValueError(f"grouped_mm: {len(sizes)} groups of {sum(sizes)} rows for {weights.shape[0]} weights "
                             f"and {x.shape[0]} rows")
        tiles = _tiles(sizes, x.device)
        ctx.save_for_backward(x, weights)
        ctx.tiles, ctx.sizes = tiles, sizes
        w = weights
        return _matmul(x, w, (w.stride(0), w.stride(1), w.stride(2)), w.shape[2], tiles)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        x, w = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dy [N, M] @ W[g]^T [M, K]: W read with dims 1 and 2 swapped
            dx = _matmul(dy, w, (w.stride(0), w.stride(2), w.stride(1)), w.shape[1], ctx.tiles)
        if ctx.needs_input_grad[1]:
            dw = torch.empty_like(w)
            offsets = torch.tensor([0, *torch.tensor(ctx.sizes).cumsum(0).tolist()], dtype=torch.int64,
                                   device=x.device)
            g, k, m = w.shape
            if g and k and m:
                grid = (g, triton.cdiv(k, BLOCK_K), triton.cdiv(m, BLOCK_N))
                _grouped_wgrad_kernel[grid](x, dy, dw, offsets, k, m, x.stride(0), x.stride(1), dy.stride(0),
                                            dy.stride(1), dw.stride(0), dw.stride(1), dw.stride(2),
                                            IEEE=_ieee(x), BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K)
        return dx, dw, None


def grouped_mm(x: torch.Tensor, weights: torch.Tensor, tokens_per_group: torch.Tensor) -> torch.Tensor:
    return GroupedMM.apply(x, weights, tokens_per_group)
