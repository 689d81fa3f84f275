"""``[moe]``: which blocks become Mixture-of-Experts layers and how they route, drop and balance tokens."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class MoESection(BaseModel):
    """``experts = 0`` (the default) leaves the model dense; the other keys only matter when it is > 0."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    experts: int = Field(default=0, ge=0, description="routed experts per MoE layer; 0 = dense model")
    top_k: int = Field(default=2, ge=1, description="experts each token is sent to")
    every: int = Field(default=1, ge=1, description="block i is an MoE layer when (i + 1) % every == 0")
    shared_experts: int = Field(default=0, ge=0, description="always-on experts added to every token")
    expert_dim: int = Field(default=0, ge=0, description="hidden size of one expert; 0 = the dense "
                            "hidden size / (top_k + shared_experts): equal active parameters")
    capacity_factor: float = Field(default=0.0, ge=0, description="0 = dropless; else capacity = "
                                   "ceil(tokens * top_k / experts * capacity_factor) per expert")
    drop_policy: Literal["probs", "position"] = Field(
        default="probs", description="with capacity_factor > 0, which choices are dropped first: probs = the "
        "lowest router weights (Megatron-Core), position = later choices, then later tokens (GShard)")
    router: Literal["softmax", "sigmoid"] = Field(default="softmax", description="router score function over the "
                                                  "experts")
    renormalize: Literal["auto", "always", "never"] = Field(
        default="auto", description="divide the top-k weights by their sum: auto = when top_k > 1; always = "
        "Mixtral's router (also for top_k = 1); never = Qwen3-MoE with norm_topk_prob = false")
    dense_layers: list[int] = Field(default_factory=list, description="blocks that stay dense whatever `every` "
                                    "says (Qwen3-MoE's mlp_only_layers)")
    jitter: float = Field(default=0.0, ge=0, lt=1, description="multiplicative router-input noise in training")
    aux_loss: Literal["micro_batch", "sequence", "global", "pooled", "none"] = Field(
        default="global", description="Switch balance-loss scope; global (expert counts over all ranks) gives "
        "(and sequence) the same run on every layout; micro_batch depends on the per-rank micro-batch; pooled = "
        "transformers' Mixtral/Qwen3-MoE loss (statistics pooled over the layers, counts over all ranks; the "
        "default for an imported MoE checkpoint)")
    aux_loss_coeff: float = Field(default=0.01, ge=0, description="weight of the load-balancing loss")
    z_loss_coeff: float = Field(default=0.001, ge=0, description="weight of the router z-loss (ST-MoE)")
    bias_update_rate: float = Field(default=0.0, ge=0, description="aux-loss-free balancing; 0 = off")
    exchange_timeout_s: float = Field(default=60.0, gt=0, description="how long an expert-parallel rank "
                                      "waits for the others to agree on split sizes before raising")
    upcycle_from: str = Field(default="", description="run dir or checkpoint of a dense run to copy every "
                              "expert from")

    @model_validator(mode="after")
    def _check(self) -> MoESection:
        if self.experts and self.top_k > self.experts:
            raise ValueError(f"moe.top_k={self.top_k} exceeds moe.experts={self.experts}; use top_k <= experts")
        return self
