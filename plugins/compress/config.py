"""The compress plugin's config sections: ``[distill]`` (knowledge distillation, ``--recipe distill``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class DistillSection(BaseModel):
    """Options of ``--recipe distill`` (docs/compress.md); names follow TRL's GKDConfig where it has one."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    teacher: str = Field(default="", description="the teacher's weights: a run dir, a checkpoint, a .safetensors "
                         "file or a Hugging Face folder (same vocabulary as the student)")
    cache: str = Field(default="", description="read the teacher's top-k log-probs from this file (written by "
                       "`crosstrain distill cache`) instead of running the teacher")
    loss: Literal["forward_kl", "reverse_kl", "jsd"] = Field(default="forward_kl", description="the divergence")
    beta: float = Field(default=0.5, ge=0, le=1, description="jsd: the mixture weight of the teacher (TRL's beta; "
                        "0 = forward KL, 1 = reverse KL)")
    temperature: float = Field(default=1.0, gt=0, description="softmax temperature of both models (loss x T^2)")
    alpha: float = Field(default=0.5, ge=0, le=1, description="weight of the divergence; 1 - alpha weighs the "
                         "label NLL")
    on_policy: float = Field(default=0.0, ge=0, le=1, description="fraction of micro-batches whose completions the "
                             "student samples (GKD's lambda)")
    sample_temperature: float = Field(default=1.0, gt=0, description="on-policy: the student's sampling temperature")
    top_k_logits: int = Field(default=0, ge=0, description="keep only the teacher's top-k tokens (+ a tail bucket); "
                              "0 = the whole vocabulary")
    data: Literal["text", "sft"] = Field(default="text", description="plain text (the lm recipe's data) or "
                                         "prompt/completion rows (the sft recipe's: loss on completion tokens only)")
    chunk_tokens: int = Field(default=1024, ge=1, description="token rows per chunk of the divergence")
