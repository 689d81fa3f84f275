"""The clipped policy-gradient surrogate: importance ratio at token or sequence level, symmetric, clip-higher
and dual clipping. Per-token values out; :mod:`.aggregate` turns them into one loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

RatioLevel = Literal["token", "sequence"]


def log_ratio(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor,
              level: RatioLevel = "token") -> torch.Tensor:
    """``log(pi / pi_old)`` per token ``[B, T]``.

    ``"token"`` (PPO, Schulman et al. 2017; GRPO): ``logp_t - old_logp_t``. ``"sequence"`` (GSPO, Zheng et al.
    2025): the length-normalised sequence ratio ``log s_i = (1/|y_i|) sum_t (logp_t - old_logp_t)``, the same
    value on every token of row ``i`` (its gradient flows through the mean). Zero where ``mask`` is False.
    """
    m = mask.to(logps.dtype)
    diff = (logps - old_logps) * m
    if level == "token":
        return diff
    if level != "sequence":
        raise ValueError(f"level={level!r} is not one of token, sequence")
    seq = diff.sum(-1) / m.sum(-1).clamp(min=1)
    return seq.unsqueeze(-1) * m


@dataclass
class Surrogate:
    """Per-token loss and which tokens each clip bound was active on (TRL's ``clip_ratio/*`` counts these)."""

    loss: torch.Tensor  # [B, T]
    clipped_low: torch.Tensor  # ratio < 1 - eps_low with A < 0
    clipped_high: torch.Tensor  # ratio > 1 + eps_high with A > 0
    dual_clipped: torch.Tensor  # the dual-clip bound -c * A was taken (A < 0)


def clipped_surrogate(log_ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float = 0.2,
                      eps_high: float | None = None, dual_clip: float = 0.0) -> Surrogate:
    """PPO's clipped objective as a per-token loss (Schulman et al. 2017):
    ``l_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)`` with ``r_t = exp(log_ratio_t)``.

    ``eps_high=None`` is the symmetric clip (``eps_high = eps_low``); a larger ``eps_high`` is DAPO's
    clip-higher (Yu et al. 2025). ``dual_clip = c > 1`` bounds the loss of negative advantages by ``-c A_t``
    (Ye et al. 2020, "Mastering Complex Control in MOBA Games"): ``l_t = min(l_t, -c A_t)`` where ``A_t < 0``.
    ``advantages`` broadcast against ``log_ratio`` (``[B, 1]`` for one per sequence).
    """
    high = eps_low if eps_high is None else eps_high
    adv = advantages.expand_as(log_ratio)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1 - eps_low, 1 + high)
    loss = -torch.min(ratio * adv, clipped * adv)
    low_hit = (ratio < 1 - eps_low) & (adv < 0)
    high_hit = (ratio > 1 + high) & (adv > 0)
    dual_hit = torch.zeros_like(low_hit)
    if dual_clip:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip={dual_clip} must be > 1 (or 0 = off)")
        bound = -dual_clip * adv
        dual_hit = (adv < 0) & (loss > bound)
        loss = torch.where(dual_hit, bound, loss)
    return Surrogate(loss, low_hit, high_hit, dual_hit)


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       clip: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss (Schulman et al. 2017; as TRL's PPOTrainer and OpenAI baselines):
    ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)`` per token, and where the clipped term won.
    ``clip=0`` turns clipping off (plain ``0.5 (V - R)^2``)."""
    plain = (values - returns) ** 2
    if not clip:
        return 0.5 * plain, torch.zeros_like(plain, dtype=torch.bool)
    clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns) ** 2
    return 0.5 * torch.max(plain, clipped), clipped > plain
