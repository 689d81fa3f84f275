"""The compress plugin's hooks: the ``[quant]`` section and the QAT model transform."""

from __future__ import annotations

from typing import Any

from crosstrain import hookimpl


@hookimpl
def crosstrain_config_sections() -> dict[str, type]:
    from crosstrain.plugins.compress.qat.config import QuantSection

    return {"quant": QuantSection}


@hookimpl(trylast=True)  # after MoE layers and LoRA adapters exist, so it sees the model that trains
def crosstrain_transform_model(model: Any, config: Any, name: str, trainable: bool) -> Any:
    from crosstrain.plugins.compress.qat.transform import transform

    return transform(model, config, name, trainable)


@hookimpl
def crosstrain_refusal_rules() -> list[Any]:
    from crosstrain.plugins.compress.qat.rules import RULES

    return list(RULES)
