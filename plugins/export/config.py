"""``[export]`` in a training config: what to export when training ends (written under ``<run dir>/export``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from crosstrain.plugins.export.defaults import DEFAULT_INT8_TOLERANCE, DEFAULT_TOLERANCE


class ExportSection(BaseModel):
    """``[export]`` in a training config: what to export when training ends (written under ``<run dir>/export``)."""

    model_config = ConfigDict(extra="forbid")

    onnx: bool = Field(default=False, description="export the trained model to ONNX (with KV cache) when training "
                                                  "ends, checked against PyTorch")
    safetensors: bool = Field(default=False, description="write the trained weights to one safetensors file when "
                                                         "training ends")
    int8: bool = Field(default=False, description="also write a dynamic-int8 ONNX model (needs onnx=true)")
    dir: str = Field(default="export", description="folder of the exports, relative to the run dir")
    tolerance: float = Field(default=DEFAULT_TOLERANCE, gt=0,
                             description="max abs logit error of the ONNX model against PyTorch")
    int8_tolerance: float = Field(default=DEFAULT_INT8_TOLERANCE, gt=0,
                                  description="max abs logit error accepted for the int8 model")
    opset: int | None = Field(default=None, description="ONNX opset (None: the exporter's default)")
