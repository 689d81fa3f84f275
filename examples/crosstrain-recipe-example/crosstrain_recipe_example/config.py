"""The ``[lm_kl]`` config section."""

from pydantic import BaseModel, ConfigDict, Field


class LMKLSection(BaseModel):
    """``[lm_kl] beta``: weight of the KL penalty to the frozen reference."""

    model_config = ConfigDict(extra="forbid")

    beta: float = Field(default=0.1, ge=0)
