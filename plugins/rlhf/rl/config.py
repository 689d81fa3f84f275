"""The ``[rl]`` and ``[reward]`` config sections of the ``grpo`` and ``ppo`` recipes (TRL's option names where
TRL has one; verl's for the aggregation modes)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class RLSection(BaseModel):
    """Rollouts and the composable loss parts (plugins/rlhf/rl; docs/rlhf.md)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    num_generations: int = Field(default=4, ge=1, description="G: completions sampled per prompt (GRPO's group)")
    max_new_tokens: int = Field(default=8, ge=1, description="tokens generated per completion")
    stop: str = Field(default="\n", description="a completion also ends after this character "
                      "('' = none), besides the tokenizer's EOS/end-of-turn tokens and generation_config.json's "
                      "eos_token_id (crosstrain.generation.stops)")
    advantage: Literal["group", "rloo"] = Field(default="group", description="grpo: group-normalised (GRPO) or "
                                                "leave-one-out (RLOO); ppo always uses GAE")
    scale_rewards: Literal["group", "batch", "none"] = Field(default="group", description="grpo advantage: divide "
                                                             "by the group's std, the batch's, or not (Dr. GRPO)")
    importance_sampling_level: Literal["token", "sequence"] = Field(default="token", description="ratio per "
                                                                    "token (PPO/GRPO) or per sequence (GSPO)")
    epsilon: float = Field(default=0.2, gt=0, lt=1, description="clip range: ratio in [1 - epsilon, 1 + epsilon_high]")
    epsilon_high: float | None = Field(default=None, gt=0, description="upper clip (DAPO clip-higher); unset = "
                                       "epsilon")
    dual_clip: float = Field(default=0.0, ge=0, description="dual-clip c > 1 bounding negative-advantage losses "
                             "by -c*A (0 = off)")
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = \
        Field(default="token-mean", description="how per-token losses are averaged (global counts)")
    beta: float = Field(default=0.0, ge=0, description="KL coefficient to the frozen reference (0 = no reference "
                        "model)")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(default="k3", description="estimator of the KL to the reference "
                                                                              "(Schulman's k1/k2/k3)")
    kl_clamp: float = Field(default=10.0, ge=0, description="log-ratio and KL estimate clamped to +-this (0 = off)")
    kl_in: Literal["loss", "reward"] = Field(default="loss", description="KL as a loss term, or as a reward "
                                             "penalty (ppo: per token, grpo: summed per completion)")
    kl_target: float = Field(default=0.0, ge=0, description="adaptive KL controller target (Ziegler et al. 2019); "
                             "0 = fixed beta")
    kl_horizon: float = Field(default=10000.0, gt=0, description="adaptive KL controller horizon (samples)")
    gamma: float = Field(default=1.0, ge=0, le=1, description="ppo GAE discount")
    lam: float = Field(default=0.95, ge=0, le=1, description="ppo GAE lambda")
    whiten_advantages: bool = Field(default=True, description="ppo: whiten advantages over the global batch")
    vf_coef: float = Field(default=0.1, ge=0, description="ppo: weight of the value loss")
    cliprange_value: float = Field(default=0.2, ge=0, description="ppo: value clip range (0 = off)")
    entropy_coef: float = Field(default=0.0, ge=0, description="entropy bonus: loss -= entropy_coef * entropy")


class RewardSection(BaseModel):
    """Where rewards come from: a Python callable, a reward model trained by ``--recipe rm``, or (neither set)
    the embedded task (crosstrain.plugins.rlhf.rl.tasks)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    fn: str = Field(default="", description='"pkg.mod:fn" called as fn(completions, prompts) -> list of floats')
    model: str = Field(default="", description="an rm run dir, checkpoint folder or FILE.safetensors (same model.* "
                       "keys as the policy); scores each prompt + completion")
    max: float = Field(default=1.0, description="the task's maximum reward, reported as eval reward_max (the "
                       "embedded task's is 1.0)")
