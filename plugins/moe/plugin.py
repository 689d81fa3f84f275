"""The MoE plugin's hooks: the ``[moe]`` section, the model transform, its contribution to the GPT family's
estimates, the aux-loss-free bias update and the expert-load report panel."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import crosstrain

if TYPE_CHECKING:  # `crosstrain config show` reads the [moe] section without importing torch
    import torch


@crosstrain.hookimpl
def crosstrain_config_sections() -> dict[str, type]:
    from crosstrain.plugins.moe.config import MoESection

    return {"moe": MoESection}


@crosstrain.hookimpl
def crosstrain_transform_model(model: torch.nn.Module, config: Any, name: str) -> torch.nn.Module | None:
    """MoE layers in every model the loop passes (trainable ones and frozen copies a recipe marks
    ``ModelSpec(transform=True)``); frozen models loaded from a source never reach it."""
    from crosstrain.plugins.moe.setup import transform

    return transform(model, config)


@crosstrain.hookimpl
def crosstrain_model_families() -> list[Any]:
    from crosstrain.plugins.moe.family import MOE_EXTENSION

    return [MOE_EXTENSION]


@crosstrain.hookimpl
def crosstrain_after_optimizer_step(context: Any, step: int) -> None:
    from crosstrain.plugins.moe.transform import moe_layers

    for name in context.optimizers:
        for layer in moe_layers(context.models[name]):
            if layer.cfg.bias_update_rate > 0:
                layer.update_bias()


@crosstrain.hookimpl
def crosstrain_report_panels() -> list[Any]:
    """The expert load the MoE layers report (``moe/<layer>/max_load``) on ``crosstrain report``."""
    from crosstrain.plugins.observability.panels import Panel

    return [Panel("moe_max_load", "MoE expert load (max share per layer)", ("moe/*/max_load",), "max load")]


@crosstrain.hookimpl
def crosstrain_refusal_rules() -> list[Any]:
    from crosstrain.plugins.moe.rules import RULES

    return list(RULES)
