"""The ``[rlhf]`` config section (TRL's option names where TRL has one)."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class RLHFSection(BaseModel):
    """Options of the ``sft``, ``rm`` and ``dpo`` recipes."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    max_length: int = Field(default=0, ge=0, description="tokens per prompt + completion (0 = train.seq_len)")
    max_prompt_length: int = Field(default=0, ge=0, description="prompt tokens kept, from the end (0 = max_length/2)")
    loss_normalization: Literal["token", "sequence"] = Field(
        default="token", description="SFT: token = TRL SFTTrainer's loss (the sum of completion-token NLLs over the "
        "step's micro-batches and data-parallel ranks / their number of completion tokens, transformers' "
        "num_items_in_batch), the default so a recipe ported from TRL trains the same; sequence = each row's mean "
        "completion NLL, averaged over rows (short and long completions weigh the same)")
    beta: float = Field(default=0.1, gt=0, description="DPO: strength of the pull to the reference")
    loss_type: Literal["sigmoid", "cdpo", "hinge", "ipo", "robust"] = Field(
        default="sigmoid", description="DPO loss (TRL's names): sigmoid (DPO), cdpo (conservative DPO, label "
        "smoothing eps), hinge (SLiC), ipo, robust (Chowdhury et al. 2024, label noise eps)")
    label_smoothing: float = Field(default=0.0, ge=0, lt=0.5, description="DPO cdpo/robust: label noise eps "
                                   "(refused with sigmoid, which ignores it in TRL)")
    margin: float = Field(default=0.0, description="RM: margin subtracted from r_chosen - r_rejected")
    center_rewards_coefficient: float = Field(default=0.0, ge=0, description="RM: c in c * mean((r_c + r_r)^2)")
    reference: Literal["frozen", "precomputed"] = Field(default="frozen", description="DPO: a frozen copy of the "
                                                        "starting weights, or their log-probs computed once before "
                                                        "training (no reference model in memory)")
    max_new_tokens: int = Field(default=16, ge=1, description="DPO eval: greedy tokens per held-out prompt (win_rate)")


class LoRASection(BaseModel):
    """``[lora]``: low-rank adapters on the GPT's linear layers (rank 0 = off)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    rank: int = Field(default=0, ge=0, description="adapter rank r (0 = no LoRA: full-parameter training)")
    alpha: float = Field(default=16.0, gt=0, description="the update is scaled by alpha / rank")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout on the adapter's input")
    targets: list[str] = Field(default_factory=lambda: ["wq", "wk", "wv", "wo", "w1", "w2", "w3"],
                               description="attribute names of the nn.Linear layers to adapt, or "
                               "\"all-linear\": every linear layer but the output head (PEFT's all-linear)")
