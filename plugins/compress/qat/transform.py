"""The ``crosstrain_transform_model`` of ``[quant]``: fake quantisation in the trained models."""

from __future__ import annotations

from typing import Any

from torch import nn

from crosstrain.plugins.compress.qat.conv import has_conv, quantize_convnet
from crosstrain.plugins.compress.qat.linear import quantize_linears
from crosstrain.plugins.compress.qat.schemes import scheme


def transform(model: nn.Module, config: Any, name: str, trainable: bool) -> nn.Module:
    """Fake-quantise ``model``'s linear layers under ``quant.qat`` when it is trained (frozen models, such as a
    teacher or a reference, keep their precision); a conv net's convolutions and linear layers statically
    (:mod:`.conv`); ``quant.qat = "none"`` returns it unchanged."""
    quant = config.section("quant")
    if quant.qat == "none" or not trainable:
        return model
    chosen = scheme(quant.qat, quant.group_size)
    if has_conv(model):
        quantize_convnet(model, chosen, what=f"model {name!r}")
    else:
        quantize_linears(model, chosen, what=f"model {name!r}")
    return model
