"""Native CPU kernels for the GPT's core ops: ``torch.autograd.Function``s over the ``_kernels`` extension.

Each op's forward and backward run in C++ (``csrc/ops``: one pass per row or block, OpenMP threads,
AVX-512 / AVX2 / generic chosen at import) on contiguous host tensors in fp32 or bf16, computing in fp32
like the references in :mod:`crosstrain.kernels.reference`. ``linear_cross_entropy`` runs the lm-head matmuls
with torch (oneDNN/MKL GEMMs) on chunks of rows and the native cross-entropy on each chunk's logits, so the
full ``[tokens, vocab]`` logits never exist. :func:`register` hands them to the kernel registry with
``supports`` predicates; any other input (other dtypes, non-contiguous or DTensor inputs, ``torch.compile``
tracing) runs the reference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from crosstrain.backends.cpu.native.extension import REBUILD, import_extension

_ext, _IMPORT_ERROR = import_extension("_kernels")

log = logging.getLogger("crosstrain.kernels")

__all__ = ["OPS", "available", "isa", "register", "rms_norm", "rotary_embedding", "swiglu", "cross_entropy",
           "linear_cross_entropy"]

#: dtype index shared with csrc/ops/ops_common.h
_CODES = {torch.float32: 0, torch.bfloat16: 1}
#: linear_cross_entropy: fp32 logits held at once (32 MiB), so rows per chunk = CHUNK_ELEMENTS // vocab; larger
#: chunks run the dW GEMM with a longer inner dimension (measured faster here), smaller ones hold less.
CHUNK_ELEMENTS = 1 << 23


def available() -> bool:
    """Whether the compiled extension is importable."""
    return _ext is not None


def isa() -> str:
    """The instruction set the kernels use (``avx512``, ``avx2``, ``generic``), or ``missing``."""
    return str(_ext.isa()) if _ext is not None else "missing"


def _threads() -> int:
    return max(1, torch.get_num_threads())


def _targets(targets: torch.Tensor) -> torch.Tensor:
    return targets if targets.dtype == torch.int64 else targets.to(torch.int64)


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        d = x.shape[-1]
        rows = x.numel() // d
        w = weight.detach().float().contiguous()
        y = torch.empty_like(x)
        rstd = torch.empty(rows, dtype=torch.float32)
        _ext.rms_norm_fwd(x.data_ptr(), w.data_ptr(), y.data_ptr(), rstd.data_ptr(), rows, d, float(eps),
                          _CODES[x.dtype], _threads())
        ctx.save_for_backward(x, w, rstd)
        ctx.weight_dtype = weight.dtype
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w, rstd = ctx.saved_tensors
        return _rms_backward(ctx, x, w, rstd, dy)


class _RmsNormResidual(torch.autograd.Function):
    """``(x, rms_norm(x))``: ``x`` passes through as an output, so the gradient of its other use (the residual
    branch) reaches this backward, and the kernel adds it to ``dx`` in its pass over each row instead of autograd
    adding the two afterwards."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        return x, _RmsNorm.forward(ctx, x, weight, eps)

    @staticmethod
    def backward(ctx: Any, dres: torch.Tensor | None, dy: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        x, w, rstd = ctx.saved_tensors
        if dy is None:
            return dres, None, None
        dres = None if dres is None else dres.to(x.dtype).contiguous()
        return _rms_backward(ctx, x, w, rstd, dy, dres)


def _rms_backward(ctx: Any, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor,
                  dres: torch.Tensor | None = None) -> tuple[torch.Tensor | None, ...]:
    dy = dy.to(x.dtype).contiguous()
    d = x.shape[-1]
    dx = torch.empty_like(x)
    dw = torch.empty(d, dtype=torch.float32)
    _ext.rms_norm_bwd(dy.data_ptr(), x.data_ptr(), w.data_ptr(), rstd.data_ptr(), dx.data_ptr(), dw.data_ptr(),
                      rstd.numel(), d, _CODES[x.dtype], _threads(), *(() if dres is None else (dres.data_ptr(),)))
    return (dx if ctx.needs_input_grad[0] else None,
            dw.to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None, None)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = cos.detach().float().contiguous()
        s = sin.detach().float().contiguous()
        ctx.save_for_backward(c, s)
        return _rotate(x, c, s, 1.0)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        c, s = ctx.saved_tensors
        return _rotate(dy.contiguous(), c, s, -1.0), None, None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    seq, heads, d = x.shape[-3], x.shape[-2], x.shape[-1]
    y = torch.empty_like(x)
    _ext.rotary(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), y.data_ptr(), x.numel() // d, seq, heads, d, sign,
                _CODES[x.dtype], _threads())
    return y


class _Swiglu(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(gate)
        _ext.swiglu_fwd(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(), _CODES[gate.dtype], _threads())
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        dy = dy.to(gate.dtype).contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        _ext.swiglu_bwd(dy.data_ptr(), gate.data_ptr(), up.data_ptr(), dgate.data_ptr(), dup.data_ptr(), gate.numel(),
                        _CODES[gate.dtype], _threads())
        return dgate, dup


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        rows, vocab = logits.shape
        targets = _targets(targets).contiguous()
        lse = torch.empty(rows, dtype=torch.float32)
        loss_rows = torch.empty(rows, dtype=torch.float32)
        total, count = _ext.cross_entropy_fwd(logits.data_ptr(), targets.data_ptr(), lse.data_ptr(),
                                              loss_rows.data_ptr(), rows, vocab, int(ignore_index),
                                              _CODES[logits.dtype], _threads())
        ctx.save_for_backward(logits, targets, lse)
        ctx.count, ctx.ignore_index = count, int(ignore_index)
        return torch.tensor(total / count if count else float("nan"), dtype=torch.float32)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, targets, lse = ctx.saved_tensors
        rows, vocab = logits.shape
        scale = float(grad) / ctx.count if ctx.count else 0.0  # every row ignored: torch's gradient is 0
        out = torch.empty_like(logits)
        _ext.cross_entropy_bwd(logits.data_ptr(), targets.data_ptr(), lse.data_ptr(), out.data_ptr(), rows, vocab,
                               ctx.ignore_index, scale, _CODES[logits.dtype], _threads())
        return out, None, None


class _LinearCrossEntropy(torch.autograd.Function):
    """Chunks of ``CHUNK_ELEMENTS // vocab`` rows: logits = h @ W^T (torch GEMM, input dtype as the reference),
    then the native kernel turns the chunk's fp32 logits into its loss and, in place, its gradient
    ``(softmax - onehot) / count``; ``dh = g @ W`` and ``dW += g^T @ h`` follow. The gradients are computed in
    forward (the loss is a scalar, so backward only scales them), the approach of Liger-Kernel's fused linear
    cross-entropy (Hsu et al. 2024, arXiv:2410.10989): three GEMMs, as the unfused op, and 32 MiB of logits."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                ignore_index: int) -> torch.Tensor:
        rows, vocab = hidden.shape[0], weight.shape[0]
        targets = _targets(targets).contiguous()
        ignore = int(ignore_index)
        count = int((targets != ignore).sum())
        scale = 1.0 / count if count else 0.0
        # forward runs under no_grad: needs_input_grad says whether autograd will ask for the gradients
        dh = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        dw = torch.zeros(weight.shape, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grads = dh is not None or dw is not None
        h_all, w = hidden.detach(), weight.detach()
        step = max(1, CHUNK_ELEMENTS // vocab)
        total = 0.0
        for start in range(0, rows, step):
            end = min(rows, start + step)
            h, t = h_all[start:end], targets[start:end]
            logits = torch.mm(h, w.t()).float()
            lse = torch.empty(end - start, dtype=torch.float32)
            loss_rows = torch.empty_like(lse)
            args = (logits.data_ptr(), t.data_ptr(), lse.data_ptr(), loss_rows.data_ptr(), end - start, vocab, ignore)
            if not grads:
                total += _ext.cross_entropy_fwd(*args, 0, _threads())[0]
                continue
            total += _ext.cross_entropy_fused(*args, scale, _threads())
            g = logits.to(hidden.dtype)
            if dh is not None:
                torch.mm(g, w, out=dh[start:end])
            if dw is not None:
                if hidden.dtype == torch.float32:
                    dw.addmm_(g.t(), h)
                else:
                    dw += torch.mm(g.t(), h).float()
        ctx.save_for_backward(*(t for t in (dh, dw) if t is not None))
        ctx.has = (dh is not None, dw is not None)
        ctx.weight_dtype = weight.dtype
        return torch.tensor(total / count if count else float("nan"), dtype=torch.float32)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = list(ctx.saved_tensors)
        dh = saved.pop(0) if ctx.has[0] else None
        dw = saved.pop(0) if ctx.has[1] else None
        g = float(grad)
        if dh is not None and g != 1.0:
            dh = dh * g
        if dw is not None:
            dw = (dw * g if g != 1.0 else dw).to(ctx.weight_dtype)
        return dh, dw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Native :func:`crosstrain.kernels.reference.rms_norm` (rows of the last dim)."""
    return _RmsNorm.apply(x, weight, eps)


def rms_norm_residual(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, rms_norm(x, weight, eps))`` with ``x``'s two gradients summed in the norm's backward kernel."""
    return _RmsNormResidual.apply(x, weight, eps)


# crosstrain.kernels.rms_norm_residual; an extension built before rms_norm_bwd took `dres` (a checkout not yet
# reinstalled) keeps the plain norm and autograd's add
if _ext is not None and "dres" in (_ext.rms_norm_bwd.__doc__ or ""):
    rms_norm.with_residual = rms_norm_residual  # type: ignore[attr-defined]


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Native :func:`crosstrain.kernels.reference.rotary_embedding` on ``[..., T, H, D]``."""
    return _Rotary.apply(x, cos, sin)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Native :func:`crosstrain.kernels.reference.swiglu`."""
    return _Swiglu.apply(gate, up)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Native :func:`crosstrain.kernels.reference.cross_entropy` (mean over the rows not ignored)."""
    return _CrossEntropy.apply(logits, targets, ignore_index)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = -100) -> torch.Tensor:
    """Native :func:`crosstrain.kernels.reference.linear_cross_entropy`, chunked over rows."""
    return _LinearCrossEntropy.apply(hidden, weight, targets, ignore_index)


# -- registry predicates -------------------------------------------------------------------------------------
def _ok(t: torch.Tensor) -> bool:
    # Plain host tensors only: DTensor (tensor parallelism) and other subclasses take the reference, and under
    # torch.compile the reference is traced so inductor can fuse it (no graph break).
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" and t.dtype in _CODES
            and t.is_contiguous() and t.numel() > 0 and not torch.compiler.is_compiling())


def _ok_targets(targets: torch.Tensor, rows: int) -> bool:
    return (type(targets) is torch.Tensor and targets.device.type == "cpu" and targets.dim() == 1
            and targets.shape[0] == rows and targets.dtype in (torch.int64, torch.int32) and targets.is_contiguous())


def supports_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> bool:
    return (_ok(x) and type(weight) in (torch.Tensor, torch.nn.Parameter) and weight.device.type == "cpu"
            and weight.dim() == 1 and weight.shape[0] == x.shape[-1] and weight.is_floating_point())


def supports_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    if not (_ok(x) and x.dim() >= 3 and x.shape[-1] % 2 == 0):
        return False
    table = (x.shape[-3], x.shape[-1] // 2)
    return all(type(c) is torch.Tensor and c.device.type == "cpu" and c.is_floating_point()
               and tuple(c.shape) == table and not c.requires_grad for c in (cos, sin))


def supports_swiglu(gate: torch.Tensor, up: torch.Tensor) -> bool:
    return _ok(gate) and _ok(up) and gate.shape == up.shape and gate.dtype == up.dtype


def supports_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> bool:
    return _ok(logits) and logits.dim() == 2 and _ok_targets(targets, logits.shape[0])


def supports_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                  ignore_index: int = -100) -> bool:
    return (_ok(hidden) and _ok(weight) and hidden.dim() == 2 and weight.dim() == 2 and hidden.dtype == weight.dtype
            and hidden.shape[1] == weight.shape[1] and _ok_targets(targets, hidden.shape[0]))


#: op -> (native implementation, registry predicate)
OPS: dict[str, tuple[Callable[..., Any], Callable[..., bool]]] = {
    "rms_norm": (rms_norm, supports_rms_norm),
    "rotary_embedding": (rotary_embedding, supports_rotary),
    "swiglu": (swiglu, supports_swiglu),
    "cross_entropy": (cross_entropy, supports_cross_entropy),
    "linear_cross_entropy": (linear_cross_entropy, supports_linear_cross_entropy),
}

_warned = False


def register(registry: Any, backend: str = "cpu") -> list[str]:
    """Register the native ops for host tensors; without the extension warn once and register none."""
    global _warned
    if _ext is None:
        if not _warned:
            _warned = True
            log.warning("native CPU kernels not built (%s); %s use the pure-torch references. To get them, %s",
                        _IMPORT_ERROR, ", ".join(OPS), REBUILD)
        return []
    label = f"native-{_ext.isa()}"
    for op, (fn, supports) in OPS.items():
        registry.register(op, fn, backend=backend, device_type="cpu", priority=10, supports=supports, label=label)
    return list(OPS)
