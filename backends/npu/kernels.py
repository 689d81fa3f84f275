"""NPU kernels: torch_npu's fused operators, each matched to the reference op's semantics.

APIs used (Ascend torch_npu API reference, "torch_npu.npu_*" pages; op-plugin docs/context/*.md):

- ``torch_npu.npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)``: returns
  ``(y, rstd)``; fp16/bf16/fp32; ``gamma`` must have ``self``'s dtype. Differentiable (RmsNormGrad).
- ``torch_npu.npu_rotary_mul(input, r1, r2, rotary_mode='half') -> Tensor``: ``r1 * input + r2 * cat(-x2, x1)``
  with ``x1, x2 = chunk(input, 2, -1)``, i.e. ``r1``/``r2`` are the full-width cos/sin (``cat(cos, cos)``),
  broadcast as ``[1, S, 1, D]`` over a ``[B, S, N, D]`` input (BSND layout). Differentiable.
- ``torch_npu.npu_swiglu(Tensor self, int dim=-1) -> Tensor``: ``silu(a) * b`` with ``a, b = chunk(self, 2, dim)``.
  Differentiable (SwiGluGrad).

Each is registered with a ``supports`` predicate; anything else (and cross-entropy, where torch's own NPU
kernel is used through the reference) goes to the reference implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from crosstrain.kernels import KernelRegistry

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _torch_npu() -> Any:
    from crosstrain.backends.npu.device import import_torch_npu

    return import_torch_npu()


def npu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return _torch_npu().npu_rms_norm(x, weight, epsilon=eps)[0]


def npu_rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    t, d = x.shape[1], x.shape[3]
    r1 = torch.cat((cos, cos), dim=-1).to(x.dtype).view(1, t, 1, d)
    r2 = torch.cat((sin, sin), dim=-1).to(x.dtype).view(1, t, 1, d)
    return _torch_npu().npu_rotary_mul(x, r1, r2)


def npu_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _torch_npu().npu_swiglu(torch.cat((gate, up), dim=-1), dim=-1)


def _on_npu(*tensors: torch.Tensor) -> bool:
    # Plain tensors only: subclasses (DTensor, ...) take the reference path.
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "npu" and t.dtype in FLOATS
               for t in tensors)


def supports_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> bool:
    return (
        _on_npu(x, weight) and weight.dtype == x.dtype and weight.dim() == 1
        and 1 <= x.dim() <= 8 and weight.shape[0] == x.shape[-1]
    )


def supports_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    if not (_on_npu(x, cos, sin) and x.dim() == 4):
        return False
    t, d = x.shape[1], x.shape[3]
    return (
        d % 2 == 0 and d < 2000  # op-plugin constraint for rotate-half: D < 2000 and even
        and tuple(cos.shape) == (t, d // 2) and tuple(sin.shape) == (t, d // 2)
        and not (cos.requires_grad or sin.requires_grad)
    )


def supports_swiglu(gate: torch.Tensor, up: torch.Tensor) -> bool:
    return _on_npu(gate, up) and gate.shape == up.shape and gate.dtype == up.dtype and gate.dim() >= 1


#: op -> (implementation, supports predicate)
NPU_OPS: dict[str, tuple[Callable[..., Any], Callable[..., bool]]] = {
    "rms_norm": (npu_rms_norm, supports_rms_norm),
    "rotary_embedding": (npu_rotary_embedding, supports_rotary),
    "swiglu": (npu_swiglu, supports_swiglu),
}


def register_npu_kernels(registry: KernelRegistry, backend: str = "npu", priority: int = 10) -> list[str]:
    for op, (fn, supports) in NPU_OPS.items():
        registry.register(op, fn, backend=backend, device_type="npu", priority=priority, supports=supports,
                          label=fn.__name__)
    return list(NPU_OPS)
