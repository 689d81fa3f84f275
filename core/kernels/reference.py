"""Pure-PyTorch, differentiable reference implementations of every core op.

These define each op's semantics: a backend's fast kernel must match them (forward and backward) within
dtype-aware tolerances, which the conformance suite checks. They also serve export (ONNX) and any device
without a faster kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from crosstrain.optim import reference as _optim_reference


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * weight``, computed in fp32 and returned in ``x.dtype``."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (out * weight.float()).to(x.dtype)


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the halves of the last dim of ``x`` (``[..., T, H, D]``) by ``cos``/``sin`` (``[T, D/2]``).

    ``out = cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)`` with ``x1, x2`` the first and second halves
    (the GPT-NeoX / Llama "rotate half" convention), in fp32, returned in ``x.dtype``.
    """
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c = cos.float().unsqueeze(-2)  # [T, 1, D/2] broadcasts over heads
    s = sin.float().unsqueeze(-2)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in fp32, returned in ``gate.dtype``."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean token cross-entropy over ``logits`` ``[N, V]`` and ``targets`` ``[N]``, in fp32 (scalar)."""
    return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index)


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T, targets)``; fast kernels may chunk it to never hold all logits."""
    return cross_entropy(hidden @ weight.t(), targets, ignore_index)


def moe_permute(tokens: torch.Tensor, expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, ...]:
    """Group token copies by expert: ``tokens`` ``[N, D]``, ``expert_ids`` ``[N, K]`` (top-k choices).

    Returns ``(permuted [N*K, D], order [N*K], tokens_per_expert [E])`` where ``order`` maps each permuted
    row back to its flattened ``(token, k)`` slot. Stable sort, so equal experts keep token order.
    """
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    k = expert_ids.shape[-1] if expert_ids.dim() > 1 else 1
    permuted = tokens.index_select(0, order // k)
    counts = torch.bincount(flat, minlength=num_experts)
    return permuted, order, counts


def moe_unpermute(
    permuted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Inverse of :func:`moe_permute`, combining the k expert outputs per token with ``weights`` ``[N, K]``."""
    n, k = weights.shape
    out = torch.empty_like(permuted)
    out.index_copy_(0, order, permuted)
    out = out.view(n, k, -1) * weights.unsqueeze(-1).to(out.dtype)
    return out.sum(dim=1)


def grouped_mm(x: torch.Tensor, weights: torch.Tensor, tokens_per_group: torch.Tensor) -> torch.Tensor:
    """Per-group matmul: rows of ``x`` ``[N, K]`` in contiguous groups times ``weights[g]`` ``[G, K, M]``.

    ``tokens_per_group`` ``[G]`` (summing to ``N``; zeros allowed) gives the group sizes, in order, as
    :func:`moe_permute` returns them. Reads the sizes with one host sync for all groups (``torch.split``
    needs them on the host), never one per group; a group with no rows gets a zero weight gradient.
    """
    sizes = tokens_per_group.tolist()
    outs = [rows @ w for rows, w in zip(torch.split(x, sizes, dim=0), weights.unbind(0), strict=True)]
    if not outs:
        return x.new_zeros((0, weights.shape[-1]))
    return torch.cat(outs, dim=0)


#: name -> (reference, one-line doc) for every op the core declares.
CORE_OPS = {
    "rms_norm": (rms_norm, "RMS normalisation over the last dim with a learned scale"),
    "rotary_embedding": (rotary_embedding, "rotary position embedding, rotate-half convention"),
    "swiglu": (swiglu, "SwiGLU activation silu(gate) * up"),
    "cross_entropy": (cross_entropy, "mean token cross-entropy in fp32"),
    "linear_cross_entropy": (linear_cross_entropy, "lm-head matmul fused with cross-entropy"),
    "moe_permute": (moe_permute, "group token copies by expert (MoE dispatch)"),
    "moe_unpermute": (moe_unpermute, "scatter expert outputs back and combine top-k (MoE combine)"),
    "grouped_mm": (grouped_mm, "per-expert matmul over contiguous token groups"),
    "adamw_step": (_optim_reference.adamw_step, "fused AdamW update of an fp32 master (+ low-precision copy)"),
    "sgd_step": (_optim_reference.sgd_step, "fused SGD (nesterov) momentum update of an fp32 master"),
}
