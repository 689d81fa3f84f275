"""The compress plugin's config sections: ``[distill]`` (knowledge distillation, ``--recipe distill``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class DistillSection(BaseModel):
    """Options of ``--recipe distill`` (docs/compress.md); names follow TRL's GKDConfig where they mean what
    GKDConfig's mean (``beta``); ``temperature``, which in GKDConfig is the sampling temperature, is refused
    (:meth:`refuse_temperature`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    teacher: str = Field(default="", description="the teacher's weights: a run dir, a checkpoint, a .safetensors "
                         "file or a Hugging Face folder (same vocabulary as the student)")
    cache: str = Field(default="", description="read the teacher's top-k log-probs from this file (written by "
                       "`crosstrain distill cache`) instead of running the teacher")
    loss: Literal["forward_kl", "reverse_kl", "jsd"] = Field(default="forward_kl", description="the divergence")
    beta: float = Field(default=0.5, ge=0, le=1, description="jsd: the mixture weight of the teacher (TRL's beta; "
                        "0 = forward KL, 1 = reverse KL)")
    loss_temperature: float = Field(default=1.0, gt=0, description="softmax temperature of both models in the "
                                    "divergence (Hinton et al. 2015: loss x T^2); not TRL GKDConfig.temperature, "
                                    "which is distill.sample_temperature")
    alpha: float = Field(default=0.5, ge=0, le=1, description="weight of the divergence; 1 - alpha weighs the "
                         "label NLL")
    on_policy: float = Field(default=0.0, ge=0, le=1, description="fraction of micro-batches whose completions the "
                             "student samples (GKD's lambda)")
    sample_temperature: float = Field(default=1.0, gt=0, description="on-policy: the student's sampling temperature "
                                      "(TRL GKDConfig.temperature)")
    top_k_logits: int = Field(default=0, ge=0, description="keep only the teacher's top-k tokens (+ a tail bucket); "
                              "0 = the whole vocabulary")
    data: Literal["text", "sft"] = Field(default="text", description="plain text (the lm recipe's data) or "
                                         "prompt/completion rows (the sft recipe's: loss on completion tokens only)")
    chunk_tokens: int = Field(default=1024, ge=1, description="token rows per chunk of the divergence")

    @model_validator(mode="before")
    @classmethod
    def refuse_temperature(cls, data: Any) -> Any:
        """``distill.temperature`` is refused: it softened the loss here, while a TRL user means GKDConfig's sampling
        temperature; each meaning has its own key, so neither a crosstrain nor a TRL config silently changes."""
        if isinstance(data, dict) and "temperature" in data:
            raise ValueError("distill.temperature is ambiguous: set distill.loss_temperature (the divergence's "
                             "softmax temperature, loss x T^2) or distill.sample_temperature (on-policy sampling, "
                             "TRL GKDConfig.temperature)")
        return data
