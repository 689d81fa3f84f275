"""``grpo``: G completions per prompt, group-normalised (or RLOO) outcome advantages, the clipped surrogate and
an optional KL to a frozen reference (Shao et al. 2024, DeepSeekMath; TRL's GRPOTrainer)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from crosstrain.config import Config
from crosstrain.errors import ConfigError
from crosstrain.plugins.rlhf.rl.advantages import group_advantages, rloo_advantages
from crosstrain.plugins.rlhf.rl.recipe import RLRecipe
from crosstrain.plugins.rlhf.rl.rollout import Packed


class GRPORecipe(RLRecipe):
    """Each completion's advantage is its reward against its group's (the same prompt's) rewards; with
    ``rl.kl_in = "reward"`` the reward is first lowered by ``beta * sum_t KL_t`` of the completion."""

    name = "grpo"

    def validate_loss(self, config: Config) -> None:
        if config.section("rl").num_generations < 2:
            raise ConfigError("--recipe grpo compares completions of one prompt: set rl.num_generations >= 2")

    def prepare(self, models: Mapping[str, nn.Module], packed: Packed, scores: torch.Tensor, kl: torch.Tensor,
                sums: dict[str, Any]) -> dict[str, torch.Tensor]:
        rewards = scores
        if self.sec.beta and self.sec.kl_in == "reward":
            rewards = scores - self.kl_ctl.beta * kl.sum(1)
        sums["adv"], sums["adv_sq"] = rewards.double().sum(), (rewards.double() ** 2).sum()
        return {"rl_rewards": rewards}

    def advantages(self, batch: Mapping[str, torch.Tensor], g: dict[str, float]) -> torch.Tensor:
        rewards = batch["rl_rewards"]
        if self.sec.advantage == "rloo":
            return rloo_advantages(rewards, self.group).unsqueeze(1)
        n = max(g["sequences"], 1.0)
        mean = g["adv"] / n
        batch_std = math.sqrt(max(g["adv_sq"] - n * mean * mean, 0.0) / max(n - 1, 1))
        return group_advantages(rewards, self.group, self.sec.scale_rewards, batch_std=batch_std).unsqueeze(1)
