"""Kernel registry and the core ops. Models call these functions; dispatch picks the fastest kernel."""

from __future__ import annotations

import torch

from crosstrain.kernels.registry import KernelImpl, KernelRegistry, OpSpec, registry

__all__ = [
    "KernelImpl",
    "KernelRegistry",
    "OpSpec",
    "registry",
    "rms_norm",
    "rotary_embedding",
    "swiglu",
    "cross_entropy",
    "linear_cross_entropy",
]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return registry.call("rms_norm", x, weight, eps)


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return registry.call("rotary_embedding", x, cos, sin)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return registry.call("swiglu", gate, up)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    return registry.call("cross_entropy", logits, targets, ignore_index)


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    return registry.call("linear_cross_entropy", hidden, weight, targets, ignore_index)
