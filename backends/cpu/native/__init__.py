"""Native CPU optimizer kernels: a pybind11 extension (``_C``) on raw host buffers.

The functions here take tensors, check them (host, contiguous, dtypes) and pass their addresses to the
extension, which runs one fused, vectorised, OpenMP-threaded pass per call. :func:`load` raises
:class:`NativeExtensionMissing` with the fix when the extension was not built.
"""

from __future__ import annotations

from types import ModuleType

import torch

from crosstrain.backends.cpu.native.extension import REBUILD, import_extension
from crosstrain.errors import KernelError

_native, _IMPORT_ERROR = import_extension("_C")

__all__ = [
    "NativeExtensionMissing",
    "available",
    "load",
    "isa",
    "set_isa",
    "adamw_step",
    "sgd_step",
    "copy_",
    "supports_adamw",
    "supports_sgd",
]

#: dtype codes shared with csrc/common.h
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_NONE = 3


class NativeExtensionMissing(KernelError):
    """The compiled extension ``crosstrain.backends.cpu.native._C`` is not importable."""


def available() -> bool:
    """Whether the compiled extension is importable."""
    return _native is not None


def load() -> ModuleType:
    """The compiled extension module, or :class:`NativeExtensionMissing` naming the fix."""
    if _native is None:
        raise NativeExtensionMissing(
            f"the native CPU optimizer extension is not built ({_IMPORT_ERROR}); {REBUILD}, or use the "
            "pure-torch reference (kernels = 'reference')"
        )
    return _native


def isa() -> str:
    """The instruction set the kernels use: ``avx512``, ``avx2`` or ``generic``."""
    return str(load().isa())


def set_isa(name: str) -> None:
    """Force an instruction set (``auto``, ``avx512``, ``avx2``, ``generic``); env ``CROSSTRAIN_NATIVE_ISA``."""
    try:
        load().set_isa(name)
    except ValueError as exc:
        raise KernelError(str(exc)) from None


def _threads() -> int:
    return max(1, torch.get_num_threads())


def _check(name: str, t: torch.Tensor, numel: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.device.type != "cpu":
        raise KernelError(f"native optimizer kernel: {name} is on {t.device}, not the host; copy it to the CPU first")
    if t.dtype not in dtypes:
        allowed = "/".join(str(d).replace("torch.", "") for d in dtypes)
        raise KernelError(
            f"native optimizer kernel: {name} has dtype {str(t.dtype).replace('torch.', '')}; it must be {allowed}"
        )
    if t.numel() != numel:
        raise KernelError(f"native optimizer kernel: {name} has {t.numel()} elements, the parameter has {numel}")
    if not t.is_contiguous():
        raise KernelError(
            f"native optimizer kernel: {name} is not contiguous; pass .contiguous() tensors or use the "
            "reference kernel (kernels = 'reference')"
        )


_LOW = (torch.float32, torch.bfloat16, torch.float16)
_F32 = (torch.float32,)


def adamw_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    max_exp_avg_sq: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool = False,
    grad_scale: float = 1.0,
) -> None:
    """Fused AdamW on host tensors; same contract as :func:`crosstrain.optim.reference.adamw_step`."""
    native = load()
    n = param.numel()
    _check("param", param, n, _F32)
    _check("grad", grad, n, _LOW)
    _check("exp_avg", exp_avg, n, _F32)
    _check("exp_avg_sq", exp_avg_sq, n, _F32)
    if max_exp_avg_sq is not None:
        _check("max_exp_avg_sq", max_exp_avg_sq, n, _F32)
    if out is not None:
        _check("out", out, n, _LOW)
    if n == 0:
        return
    native.adamw_step(
        param.data_ptr(), grad.data_ptr(), _DTYPE_CODES[grad.dtype], exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
        0 if max_exp_avg_sq is None else max_exp_avg_sq.data_ptr(), 0 if out is None else out.data_ptr(),
        _NONE if out is None else _DTYPE_CODES[out.dtype], n, float(lr), float(beta1), float(beta2), float(eps),
        float(weight_decay), int(step), bool(maximize), float(grad_scale), _threads(),
    )


def sgd_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    first_step: bool = False,
    maximize: bool = False,
    grad_scale: float = 1.0,
) -> None:
    """Fused SGD on host tensors; same contract as :func:`crosstrain.optim.reference.sgd_step`."""
    native = load()
    n = param.numel()
    _check("param", param, n, _F32)
    _check("grad", grad, n, _LOW)
    if momentum != 0.0:
        if momentum_buffer is None:
            raise KernelError("native optimizer kernel: momentum != 0 needs a momentum_buffer tensor")
        _check("momentum_buffer", momentum_buffer, n, _F32)
    if out is not None:
        _check("out", out, n, _LOW)
    if n == 0:
        return
    native.sgd_step(
        param.data_ptr(), grad.data_ptr(), _DTYPE_CODES[grad.dtype],
        0 if momentum_buffer is None or momentum == 0.0 else momentum_buffer.data_ptr(),
        0 if out is None else out.data_ptr(), _NONE if out is None else _DTYPE_CODES[out.dtype], n, float(lr),
        float(momentum), float(dampening), float(weight_decay), bool(nesterov), bool(first_step), bool(maximize),
        float(grad_scale), _threads(),
    )


def copy_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Parallel memcpy between two contiguous host tensors of the same byte size (bandwidth probes)."""
    native = load()
    nbytes = src.numel() * src.element_size()
    if dst.numel() * dst.element_size() != nbytes or not (dst.is_contiguous() and src.is_contiguous()):
        raise KernelError("copy_: dst and src must be contiguous host tensors of the same byte size")
    native.copy_bytes(dst.data_ptr(), src.data_ptr(), nbytes, _threads())


def _on_host_contiguous(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.device.type == "cpu" and t.is_contiguous()) for t in tensors)


def supports_adamw(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq=None, out=None, **_: object) -> bool:
    """Registry predicate: the native kernel takes these tensors (otherwise the reference runs)."""
    return (
        _native is not None
        and param.dtype == torch.float32
        and grad.dtype in _LOW
        and exp_avg.dtype == torch.float32
        and exp_avg_sq.dtype == torch.float32
        and (max_exp_avg_sq is None or max_exp_avg_sq.dtype == torch.float32)
        and (out is None or out.dtype in _LOW)
        and not grad.is_sparse
        and _on_host_contiguous(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, out)
    )


def supports_sgd(param, grad, momentum_buffer=None, out=None, **kwargs: object) -> bool:
    """Registry predicate for :func:`sgd_step`."""
    needs_buf = kwargs.get("momentum", 0.0) != 0.0
    return (
        _native is not None
        and param.dtype == torch.float32
        and grad.dtype in _LOW
        and (not needs_buf or (momentum_buffer is not None and momentum_buffer.dtype == torch.float32))
        and (out is None or out.dtype in _LOW)
        and not grad.is_sparse
        and _on_host_contiguous(param, grad, momentum_buffer if needs_buf else None, out)
    )


def register(registry: object, backend: str = "cpu") -> bool:
    """Register the native ``adamw_step`` / ``sgd_step`` for host tensors; False when the extension is missing."""
    if _native is None:
        return False
    label = f"native-{_native.isa()}"
    registry.register("adamw_step", adamw_step, backend=backend, device_type="cpu", priority=10,  # type: ignore[attr-defined]
                      supports=supports_adamw, label=label)
    registry.register("sgd_step", sgd_step, backend=backend, device_type="cpu", priority=10,  # type: ignore[attr-defined]
                      supports=supports_sgd, label=label)
    return True
