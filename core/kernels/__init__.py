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
    "rms_norm_residual",
    "rotary_embedding",
    "swiglu",
    "cross_entropy",
    "linear_cross_entropy",
    "moe_permute",
    "moe_unpermute",
    "grouped_mm",
]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return registry.call("rms_norm", x, weight, eps)


def rms_norm_residual(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, rms_norm(x, weight, eps))`` for an ``x`` that also feeds a residual add: an ``rms_norm`` implementation
    with a ``with_residual`` attribute (the native CPU one) returns ``x`` through its autograd function and adds the
    residual's gradient to ``dx`` inside its backward kernel, sparing autograd's separate add; any other runs the
    plain op (the same values)."""
    x, weight = registry.plain_args(x, weight)  # the kernel call() would pick (a pending collective: a plain copy)
    impl = registry.resolve("rms_norm", x, weight, eps)
    fused = getattr(impl, "with_residual", None)
    return fused(x, weight, eps) if fused is not None else (x, impl(x, weight, eps))


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


def moe_permute(
    tokens: torch.Tensor, expert_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(permuted, order, tokens_per_expert)``: token copies grouped by expert (see ``reference.moe_permute``)."""
    return registry.call("moe_permute", tokens, expert_ids, num_experts)


def moe_unpermute(permuted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Undo :func:`moe_permute` and sum each token's top-k expert outputs weighted by ``weights`` ``[N, K]``."""
    return registry.call("moe_unpermute", permuted, order, weights)


def grouped_mm(x: torch.Tensor, weights: torch.Tensor, tokens_per_group: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` in contiguous groups times ``weights[g]`` (see ``reference.grouped_mm``)."""
    return registry.call("grouped_mm", x, weights, tokens_per_group)
