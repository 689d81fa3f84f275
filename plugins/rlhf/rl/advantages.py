"""Advantage estimators: GAE for PPO, group-normalised for GRPO (and Dr. GRPO), RLOO leave-one-out, whitening."""

from __future__ import annotations

from typing import Literal

import torch

GroupScale = Literal["group", "batch", "none"]


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE").

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``, with ``V`` and ``A``
    zero after the last valid token of each row. ``rewards``, ``values``, ``mask`` are ``[B, T]`` (mask True on
    the completion's tokens, a prefix of each row). Returns ``(advantages, returns = advantages + values)``,
    zero where ``mask`` is False.
    """
    m = mask.to(values.dtype)
    r, v = rewards * m, values * m
    adv = torch.zeros_like(v)
    running = torch.zeros_like(v[:, 0])
    next_value = torch.zeros_like(v[:, 0])
    for t in reversed(range(v.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        running = (delta + gamma * lam * running) * m[:, t]
        adv[:, t] = running
        next_value = v[:, t]
    return adv, (adv + v) * m


def group_advantages(rewards: torch.Tensor, group_size: int, scale: GroupScale = "group",
                     batch_std: torch.Tensor | float | None = None, eps: float = 1e-4) -> torch.Tensor:
    """GRPO's outcome advantage (Shao et al. 2024, DeepSeekMath): ``A_i = (r_i - mean_group(r)) / (s + eps)``.

    ``rewards [N]`` hold ``N / group_size`` groups of consecutive completions of one prompt. ``scale`` picks ``s``:
    ``"group"`` the group's std (unbiased, as TRL), ``"batch"`` the std over the whole (global) batch, passed as
    ``batch_std`` (TRL ``scale_rewards="batch"``), ``"none"`` no division (Dr. GRPO, Liu et al. 2025, removes the
    std's difficulty bias). Returns ``[N]``.
    """
    g = rewards.view(-1, group_size)
    centred = g - g.mean(dim=1, keepdim=True)
    if scale == "group":
        centred = centred / (g.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        if batch_std is None:
            raise ValueError("group_advantages(scale='batch') needs batch_std (the std of the global batch)")
        centred = centred / (torch.as_tensor(batch_std, dtype=rewards.dtype) + eps)
    elif scale != "none":
        raise ValueError(f"scale={scale!r} is not one of group, batch, none")
    return centred.reshape(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, "Back to Basics"): each completion's baseline is the mean
    reward of the other ``k - 1`` completions of its prompt, ``A_i = r_i - (sum_j r_j - r_i) / (k - 1)``."""
    if group_size < 2:
        raise ValueError("RLOO needs at least 2 completions per prompt (rl.num_generations >= 2)")
    g = rewards.view(-1, group_size)
    baseline = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    return (g - baseline).reshape(-1)


def whiten(values: torch.Tensor, mask: torch.Tensor, mean: torch.Tensor | float, var: torch.Tensor | float,
           shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Whitened advantages (as in Ziegler et al. 2019 / TRL ``masked_whiten``): ``(x - mean) / sqrt(var + eps)``
    over valid tokens, with ``mean`` and ``var`` of the global batch's valid tokens (passed in: computed from
    all-reduced sums); ``shift_mean=False`` keeps the mean. Zero where ``mask`` is False."""
    out = (values - mean) * torch.rsqrt(torch.as_tensor(var, dtype=values.dtype) + eps)
    if not shift_mean:
        out = out + mean
    return out * mask.to(values.dtype)
