"""``[quant]``: which fake-quantisation scheme training inserts into the linear layers."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

QATScheme = Literal["none", "int8", "int8-act-int4-weight"]


class QuantSection(BaseModel):
    """``qat = "none"`` (the default) trains in floating point; the other keys only matter when it is set."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    qat: QATScheme = Field(default="none", description="int8: int8 per-token activations + int8 per-channel "
                           "weights; int8-act-int4-weight: int8 per-token activations + int4 weights per group")
    group_size: int = Field(default=32, ge=2, description="int4 weights: input features sharing one scale; must "
                            "divide every quantised layer's in_features")
