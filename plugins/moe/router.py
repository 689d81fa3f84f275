"""The router: fp32 scores over the experts, top-k choice (optionally biased) and the combine weights."""

from __future__ import annotations

import torch


def router_scores(logits: torch.Tensor, kind: str) -> torch.Tensor:
    """``softmax(logits)`` (Switch/GShard, Mixtral) or ``sigmoid(logits)`` (DeepSeek-V3), always in fp32."""
    logits = logits.float()
    if kind == "softmax":
        return torch.softmax(logits, dim=-1)
    if kind == "sigmoid":
        return torch.sigmoid(logits)
    raise ValueError(f"moe.router={kind!r} is not allowed; use softmax or sigmoid")


def routing_distribution(scores: torch.Tensor, kind: str) -> torch.Tensor:
    """Scores as a distribution over experts (rows sum to 1): softmax scores as they are, sigmoid ones divided
    by their sum (DeepSeek-V3's normalisation); what the balancing loss and the entropy metric read."""
    return scores if kind == "softmax" else scores / scores.sum(dim=-1, keepdim=True).clamp_min(1e-20)


def top_k(scores: torch.Tensor, k: int, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(expert ids [N, k], weights [N, k])``: the ``k`` best experts of each row of ``scores [N, E]``.

    ``bias`` (aux-loss-free balancing, DeepSeek-V3 eq. 16) shifts the *choice* only; the weights are the
    unbiased scores of the chosen experts, renormalised to sum to 1 when ``k > 1`` (Mixtral, DeepSeek-V3).
    """
    choice = scores if bias is None else scores + bias.to(scores.dtype)
    ids = torch.topk(choice, k, dim=-1).indices
    weights = scores.gather(-1, ids)
    if k > 1:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    return ids, weights


def jitter(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Switch Transformer's router jitter: ``x * U(1 - eps, 1 + eps)`` elementwise (Fedus et al. 2021, 2.2)."""
    if eps <= 0:
        return x
    return x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
