"""Expert capacity: how many token copies an expert takes, and which ones it keeps when more arrive."""

from __future__ import annotations

import math

import torch


def expert_capacity(tokens: int, top_k: int, experts: int, factor: float) -> int:
    """``ceil(tokens * top_k / experts * factor)`` (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021 eq. 3)."""
    return math.ceil(tokens * top_k / experts * factor)


def capacity_keep(ids: torch.Tensor, weights: torch.Tensor, experts: int, capacity: int,
                  policy: str = "probs") -> torch.Tensor:
    """Boolean ``[N, k]``: which choices ``ids [N, k]`` fit in their expert's ``capacity``.

    ``policy="position"``: first choices of all tokens before second choices, then token order (GShard's
    priority). ``"probs"``: the choices with the largest ``weights`` first (Megatron-Core's ``probs`` drop).
    """
    n, k = ids.shape
    flat = ids.t().reshape(-1)  # k-major: every token's first choice, then every second choice
    if policy == "probs":
        priority = torch.argsort(-weights.detach().t().reshape(-1), stable=True)
    elif policy == "position":
        priority = torch.arange(flat.numel(), device=ids.device)
    else:
        raise ValueError(f"moe.drop_policy={policy!r} is not allowed; use probs or position")
    order = priority[torch.argsort(flat[priority], stable=True)]  # by expert, in priority order within one
    counts = torch.bincount(flat, minlength=experts)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(flat.numel(), device=ids.device) - starts[flat[order]]
    keep = torch.zeros(flat.numel(), dtype=torch.bool, device=ids.device)
    keep[order] = position < capacity
    return keep.view(k, n).t()
