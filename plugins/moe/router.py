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


def renormalizes(k: int, renormalize: str = "auto") -> bool:
    """Whether the ``k`` chosen weights are divided by their sum: ``"auto"`` when ``k > 1`` (Switch's top-1 keeps
    the raw probability), ``"always"`` (transformers' Mixtral router, even for ``k = 1``), ``"never"`` (Qwen3-MoE
    with ``norm_topk_prob = false``)."""
    if renormalize not in ("auto", "always", "never"):
        raise ValueError(f"moe.renormalize={renormalize!r} is not allowed; use auto, always or never")
    return renormalize == "always" or (renormalize == "auto" and k > 1)


def top_k(scores: torch.Tensor, k: int, bias: torch.Tensor | None = None,
          renormalize: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``(expert ids [N, k], weights [N, k])``: the ``k`` best experts of each row of ``scores [N, E]``.

    ``bias`` (aux-loss-free balancing, DeepSeek-V3 eq. 16) shifts the *choice* only; the weights are the
    unbiased scores of the chosen experts, divided by their sum when :func:`renormalizes` says so. For softmax
    scores, renormalising is ``softmax`` over the chosen logits (:func:`top_k_softmax`, Mixtral's formulation).
    """
    choice = scores if bias is None else scores + bias.to(scores.dtype)
    ids = torch.topk(choice, k, dim=-1).indices
    weights = scores.gather(-1, ids)
    if renormalizes(k, renormalize):
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    return ids, weights


def top_k_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k first, then softmax over the ``k`` chosen logits (Mixtral, Jiang et al. 2024 eq. 2:
    ``G(x) = softmax(TopK(x W_g))``). Equal to softmax over all experts, top-k and renormalisation (transformers'
    ``MixtralTopKRouter``): ``exp(l_i) / sum_{j in topk} exp(l_j)`` either way, since the softmax is monotone and
    its normaliser cancels."""
    top = torch.topk(logits.float(), k, dim=-1)
    return top.indices, torch.softmax(top.values, dim=-1)


def jitter(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Switch Transformer's router jitter: ``x * U(1 - eps, 1 + eps)`` elementwise (Fedus et al. 2021, 2.2)."""
    if eps <= 0:
        return x
    return x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
