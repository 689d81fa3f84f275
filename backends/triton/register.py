"""Registration of the shared Triton kernels, without importing triton.

The registered functions are thin wrappers that import the kernel module on first call. ``supports``
predicates keep the fast path to inputs the kernels were written for (device, dtype, contiguity, shapes);
anything else falls back to the reference op through the registry.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

from crosstrain.backends.triton import triton_installed
from crosstrain.kernels import KernelRegistry

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
#: rms_norm: widest last dim of the single-pass kernel (kept equal to rms_norm.MAX_WIDTH, without importing it).
RMS_MAX_WIDTH = 16384
#: rotary: widest head dim.
ROTARY_MAX_HEAD_DIM = 1024


@functools.cache
def _module(name: str) -> Any:
    return importlib.import_module(f"crosstrain.backends.triton.{name}")


def _lazy(module: str, fn: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(_module(module), fn)(*args, **kwargs)

    call.__name__ = f"triton_{fn}"
    call.__qualname__ = call.__name__
    call.__doc__ = f"Triton kernel crosstrain.backends.triton.{module}.{fn} (imported on first call)."
    return call


def _ok(t: torch.Tensor, device_type: str) -> bool:
    # Plain tensors only: tensor subclasses (DTensor under tensor parallelism, ...) take the reference path.
    # Under torch.compile the reference is traced instead, so inductor fuses it with its neighbours (no graph break).
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == device_type and t.dtype in FLOATS
        and t.is_contiguous() and not torch.compiler.is_compiling()
    )


def supports_rms_norm(device_type: str) -> Callable[..., bool]:
    def supports(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> bool:
        return (
            _ok(x, device_type) and _ok(weight, device_type) and x.dim() >= 1 and weight.dim() == 1
            and 0 < x.shape[-1] <= RMS_MAX_WIDTH and weight.shape[0] == x.shape[-1]
        )

    return supports


def supports_rotary(device_type: str) -> Callable[..., bool]:
    def supports(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        if not (_ok(x, device_type) and x.dim() >= 3):
            return False
        t, d = x.shape[-3], x.shape[-1]
        return (
            d % 2 == 0 and 0 < d <= ROTARY_MAX_HEAD_DIM
            and all(c.device == x.device and c.dtype in FLOATS and tuple(c.shape) == (t, d // 2) for c in (cos, sin))
            and not (cos.requires_grad or sin.requires_grad)  # the kernel does not differentiate cos/sin
        )

    return supports


def supports_swiglu(device_type: str) -> Callable[..., bool]:
    def supports(gate: torch.Tensor, up: torch.Tensor) -> bool:
        return _ok(gate, device_type) and _ok(up, device_type) and gate.shape == up.shape and gate.dtype == up.dtype

    return supports


def supports_cross_entropy(device_type: str) -> Callable[..., bool]:
    def supports(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> bool:
        return (
            _ok(logits, device_type) and logits.dim() == 2 and logits.shape[1] > 0
            and targets.dim() == 1 and targets.shape[0] == logits.shape[0] and targets.device == logits.device
            and targets.dtype in (torch.int64, torch.int32) and targets.is_contiguous()
        )

    return supports


def supports_linear_cross_entropy(device_type: str) -> Callable[..., bool]:
    def supports(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> bool:
        return (
            _ok(hidden, device_type) and _ok(weight, device_type) and hidden.dim() == 2 and weight.dim() == 2
            and hidden.dtype == weight.dtype and hidden.shape[1] == weight.shape[1] and weight.shape[0] > 0
            and targets.dim() == 1 and targets.shape[0] == hidden.shape[0] and targets.device == hidden.device
            and targets.dtype in (torch.int64, torch.int32) and targets.is_contiguous()
        )

    return supports


def supports_grouped_mm(device_type: str) -> Callable[..., bool]:
    def supports(x: torch.Tensor, weights: torch.Tensor, tokens_per_group: torch.Tensor) -> bool:
        return (
            _ok(x, device_type) and _ok(weights, device_type) and x.dim() == 2 and weights.dim() == 3
            and x.dtype == weights.dtype and x.shape[1] == weights.shape[1]
            and type(tokens_per_group) is torch.Tensor and tokens_per_group.dim() == 1
            and not tokens_per_group.is_floating_point() and tokens_per_group.shape[0] == weights.shape[0]
        )

    return supports


def supports_moe_permute(device_type: str) -> Callable[..., bool]:
    def supports(tokens: torch.Tensor, expert_ids: torch.Tensor, num_experts: int) -> bool:
        return (
            _ok(tokens, device_type) and tokens.dim() == 2 and type(expert_ids) is torch.Tensor
            and expert_ids.device == tokens.device and not expert_ids.is_floating_point()
            and expert_ids.dim() in (1, 2) and expert_ids.shape[0] == tokens.shape[0]
        )

    return supports


def supports_moe_unpermute(device_type: str) -> Callable[..., bool]:
    def supports(permuted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> bool:
        return (
            _ok(permuted, device_type) and permuted.dim() == 2 and type(weights) is torch.Tensor
            and weights.dim() == 2 and weights.device == permuted.device and weights.is_floating_point()
            and type(order) is torch.Tensor and order.dim() == 1 and order.numel() == permuted.shape[0]
            and weights.numel() == permuted.shape[0]
        )

    return supports


#: op -> (kernel module, function, supports-predicate factory)
TRITON_OPS: dict[str, tuple[str, str, Callable[[str], Callable[..., bool]]]] = {
    "rms_norm": ("rms_norm", "rms_norm", supports_rms_norm),
    "rotary_embedding": ("rotary", "rotary_embedding", supports_rotary),
    "swiglu": ("swiglu", "swiglu", supports_swiglu),
    "cross_entropy": ("cross_entropy", "cross_entropy", supports_cross_entropy),
    "linear_cross_entropy": ("cross_entropy", "linear_cross_entropy", supports_linear_cross_entropy),
    "grouped_mm": ("grouped_mm", "grouped_mm", supports_grouped_mm),
    "moe_permute": ("moe_permute", "moe_permute", supports_moe_permute),
    "moe_unpermute": ("moe_permute", "moe_unpermute", supports_moe_unpermute),
}


def register_triton_kernels(
    registry: KernelRegistry, backend: str, device_type: str = "cuda", priority: int = 10
) -> list[str]:
    """Register every Triton op for ``backend`` on ``device_type``; returns the op names (none without triton)."""
    if not triton_installed():
        return []
    for op, (module, fn, supports) in TRITON_OPS.items():
        registry.register(
            op, _lazy(module, fn), backend=backend, device_type=device_type, priority=priority,
            supports=supports(device_type), label=f"triton_{fn}",
        )
    return list(TRITON_OPS)
