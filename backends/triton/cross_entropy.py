"""Cross-entropy and chunked linear + cross-entropy in Triton (semantics: ``reference.cross_entropy`` and
``reference.linear_cross_entropy``: mean over non-ignored targets, fp32 result).

Forward: one program per row streams the vocabulary in blocks with an online log-sum-exp and stores the
row's loss and ``lse``. Backward: ``(softmax - onehot) * grad / n_valid`` recomputed from ``lse``; the kernel
may write in place over the logits (used by the fused linear + cross-entropy).

``linear_cross_entropy`` never materialises the full ``[N, V]`` logits: rows are processed in chunks; for
each chunk the logits are computed, the loss taken, and (when gradients are needed) the logits buffer is
overwritten by its gradient and folded into ``grad_hidden`` and an fp32 ``grad_weight`` right away
(the approach of Liger-Kernel's fused linear cross-entropy), with ``grad_weight`` accumulated in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from crosstrain.backends.triton.launch import Launcher, make_configs


@triton.jit
def _ce_fwd(X, TGT, LOSS, LSE, stride, V, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = X + row * stride
    cols = tl.arange(0, BLOCK)
    m = float("-inf")
    acc = 0.0
    for start in range(0, V, BLOCK):
        offs = start + cols
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        acc = acc * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(acc)
    tl.store(LSE + row, lse)
    t = tl.load(TGT + row)
    if t == ignore_index:
        tl.store(LOSS + row, 0.0)
    else:
        xt = tl.load(base + t).to(tl.float32)
        tl.store(LOSS + row, lse - xt)


@triton.jit
def _ce_bwd(X, TGT, LSE, DX, SCALE, stride, dstride, V, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    t = tl.load(TGT + row)
    scale = tl.load(SCALE)
    lse = tl.load(LSE + row)
    valid = t != ignore_index
    for start in range(0, V, BLOCK):
        offs = start + cols
        mask = offs < V
        x = tl.load(X + row * stride + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - tl.where(offs == t, 1.0, 0.0)
        g = tl.where(valid, g * scale, 0.0)
        tl.store(DX + row * dstride + offs, g.to(DX.dtype.element_ty), mask=mask)


def _fwd_configs() -> list:
    return make_configs([256, 512, 1024], [{"BLOCK": 4096}, {"BLOCK": 2048}, {"BLOCK": 8192}])


def _bwd_configs() -> list:
    return make_configs([512], [{"BLOCK": 4096}])


_fwd = Launcher(_ce_fwd, _fwd_configs, key=["V"])
# The backward may run in place over the logits, so it is never autotuned (repeated timing runs would corrupt it).
_bwd = Launcher(_ce_bwd, _bwd_configs, key=["V"], tune=False)


def _row_losses(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, v = logits.shape
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        _fwd[(n,)](logits, targets, loss, lse, logits.stride(0), v, ignore_index)
    return loss, lse


def _grad_logits(
    logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor, ignore_index: int,
    out: torch.Tensor,
) -> torch.Tensor:
    n, v = logits.shape
    if n:
        _bwd[(n,)](logits, targets, lse, out, scale, logits.stride(0), out.stride(0), v, ignore_index)
    return out


def _n_valid(targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    # 0 valid targets gives 0/0 = nan, exactly like F.cross_entropy(reduction="mean").
    return (targets != ignore_index).sum().to(torch.float32)


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:  # type: ignore[override]
        loss, lse = _row_losses(logits, targets, ignore_index)
        n_valid = _n_valid(targets, ignore_index)
        ctx.save_for_backward(logits, targets, lse, n_valid)
        ctx.ignore_index = ignore_index
        return loss.sum() / n_valid

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        logits, targets, lse, n_valid = ctx.saved_tensors
        scale = (grad.to(torch.float32) / n_valid).reshape(1)
        dx = _grad_logits(logits, targets, lse, scale, ctx.ignore_index, torch.empty_like(logits))
        return dx, None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    return CrossEntropyFunction.apply(logits, targets, ignore_index)


#: logits elements per chunk of linear_cross_entropy (2**27 = 256 MiB of bf16 logits, vs N*V for the whole).
CHUNK_ELEMENTS = 1 << 27


def chunk_rows(n: int, vocab: int, budget: int = CHUNK_ELEMENTS) -> int:
    """Rows per chunk: the largest power of two whose ``[rows, vocab]`` logits fit in ``budget`` elements.

    Large chunks keep the per-chunk fp32 ``grad_weight`` update (one ``[V, H]`` temporary each) rare.
    """
    rows = max(1, budget // max(vocab, 1))
    return max(1, min(n, 1 << (rows.bit_length() - 1)))


def _lce_forward(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int, need_grad: bool,
    chunk: int | None = None, need_hidden: bool = True, need_weight: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Loss, and (``need_grad``) the gradients of the mean loss w.r.t. ``hidden`` and ``weight`` (None if unneeded)."""
    n = hidden.shape[0]
    v = weight.shape[0]
    chunk = chunk or chunk_rows(n, v)
    n_valid = _n_valid(targets, ignore_index)
    scale = (1.0 / n_valid).reshape(1)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_grad and need_hidden else None
    grad_weight = (
        torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grad and need_weight else None
    )
    # Matmuls run in the inputs' dtype: autocast must not recast them (nor reject the out= buffer).
    with torch.autocast(hidden.device.type, enabled=False):
        for start in range(0, n, chunk):
            _lce_chunk(hidden, weight, targets, start, chunk, ignore_index, scale, total, grad_hidden, grad_weight,
                       need_grad)
    return total / n_valid, grad_hidden, grad_weight


def _lce_chunk(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, start: int, chunk: int, ignore_index: int,
    scale: torch.Tensor, total: torch.Tensor, grad_hidden: torch.Tensor | None, grad_weight: torch.Tensor | None,
    need_grad: bool,
) -> None:
    """One chunk of rows: add its loss to ``total``; fold its logits gradient into the gradient buffers."""
    h_c = hidden[start : start + chunk]
    t_c = targets[start : start + chunk]
    logits = h_c @ weight.t()
    loss, lse = _row_losses(logits, t_c, ignore_index)
    total += loss.sum()
    if not need_grad:
        return
    _grad_logits(logits, t_c, lse, scale, ignore_index, logits)  # in place: logits -> d loss / d logits
    if grad_hidden is not None:
        torch.matmul(logits, weight, out=grad_hidden[start : start + chunk])
    if grad_weight is not None:
        grad_weight += logits.t() @ h_c


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int
    ) -> torch.Tensor:
        loss, gh, gw = _lce_forward(hidden, weight, targets, ignore_index, need_grad=True,
                                    need_hidden=ctx.needs_input_grad[0], need_weight=ctx.needs_input_grad[1])
        ctx.save_for_backward(gh, gw)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        gh, gw = ctx.saved_tensors
        g = grad.to(torch.float32)
        dh = (gh * g).to(gh.dtype) if gh is not None else None
        dw = (gw * g).to(ctx.weight_dtype) if gw is not None else None
        return dh, dw, None, None


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return LinearCrossEntropyFunction.apply(hidden, weight, targets, ignore_index)
    return _lce_forward(hidden, weight, targets, ignore_index, need_grad=False)[0]
