"""``ppo``: a value model (the GPT with a scalar head), per-token rewards (the score on the last token, the KL
penalty on every token), GAE, whitened advantages, clipped value loss, entropy bonus and a fixed or adaptive
KL coefficient (Schulman et al. 2017; Ziegler et al. 2019; TRL's PPOTrainer)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from crosstrain.config import Config
from crosstrain.engine.recipe import ModelSpec
from crosstrain.errors import ConfigError
from crosstrain.models.family import swap_scalar_head
from crosstrain.plugins.rlhf.rl.advantages import gae, whiten
from crosstrain.plugins.rlhf.rl.aggregate import aggregate
from crosstrain.plugins.rlhf.rl.policy_loss import clipped_value_loss
from crosstrain.plugins.rlhf.rl.recipe import RLRecipe
from crosstrain.plugins.rlhf.rl.rollout import Packed, completion_logits


class PPORecipe(RLRecipe):
    """The value model starts as a copy of the policy with its LM head replaced by a zero ``Linear(dim, 1)``
    (so V = 0 at first) and is trained with the policy (its own optimizer; ``rl.vf_coef`` weighs its loss)."""

    name = "ppo"

    def validate_loss(self, config: Config) -> None:
        if config.model.tie_embeddings:
            raise ConfigError("--recipe ppo needs model.tie_embeddings=false (its value head replaces the LM head)")

    def extra_models(self, config: Config, policy: nn.Module) -> dict[str, ModelSpec]:
        value = swap_scalar_head(copy.deepcopy(policy), "zeros", who="--recipe ppo")
        return {"value": ModelSpec(value)}

    def _values(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return completion_logits(model, batch["ids"], batch["index"])[..., 0].float()

    def prepare(self, models: Mapping[str, nn.Module], packed: Packed, scores: torch.Tensor, kl: torch.Tensor,
                sums: dict[str, Any]) -> dict[str, torch.Tensor]:
        mask = packed.mask
        values = self._values(models["value"], {"ids": packed.ids, "index": packed.index}) * mask
        rewards = torch.zeros_like(values)
        if self.sec.beta and self.sec.kl_in == "reward":
            rewards = rewards - self.kl_ctl.beta * kl
        last = (mask.sum(1) - 1).clamp(min=0)
        rewards[torch.arange(len(scores)), last] += scores * (mask.sum(1) > 0)
        adv, returns = gae(rewards, values, mask, self.sec.gamma, self.sec.lam)
        sums["adv"], sums["adv_sq"] = adv.double().sum(), (adv.double() ** 2).sum()
        return {"old_values": values, "gae_advantages": adv, "returns": returns}

    def advantages(self, batch: Mapping[str, torch.Tensor], g: dict[str, float]) -> torch.Tensor:
        adv = batch["gae_advantages"]
        if not self.sec.whiten_advantages:
            return adv
        n = max(g["tokens"], 1.0)
        mean = g["adv"] / n
        var = max(g["adv_sq"] - n * mean * mean, 0.0) / max(n - 1, 1)  # unbiased, as TRL's masked_var
        return whiten(adv, batch["mask"], mean, var)

    def extra_loss(self, models: Mapping[str, nn.Module], batch: Mapping[str, torch.Tensor], g: dict[str, float],
                   terms: int) -> tuple[torch.Tensor, dict[str, Any]]:
        mask = batch["mask"]
        values = self._values(models["value"], batch)
        vloss, clipped = clipped_value_loss(values, batch["old_values"], batch["returns"], self.sec.cliprange_value)
        share = aggregate(vloss, mask, "token-mean", tokens=g["tokens"], sequences=g["sequences"]) * terms
        clipfrac = aggregate(clipped.float(), mask, "token-mean", tokens=g["tokens"], sequences=1) * terms
        return self.sec.vf_coef * share, {"loss/value": share.detach(), "val/clipfrac": clipfrac}
