"""The compress plugin's hooks (thin: the work is in :mod:`crosstrain.plugins.compress.distill` and
:mod:`crosstrain.plugins.compress.qat`): the ``distill`` recipe, its ``[distill]`` section, ``crosstrain distill
cache``, the report panels of its metrics; the ``[quant]`` section and the QAT model transform."""

from __future__ import annotations

import argparse
from typing import Any

from crosstrain import hookimpl

RECIPES = ("distill",)


@hookimpl
def crosstrain_recipe(name: str) -> Any:
    if name == "distill":
        from crosstrain.plugins.compress.distill.recipe import DistillRecipe

        return DistillRecipe()
    return None


@hookimpl
def crosstrain_recipe_names() -> list[str]:
    return list(RECIPES)


@hookimpl
def crosstrain_config_sections() -> dict[str, type]:
    from crosstrain.plugins.compress.config import DistillSection
    from crosstrain.plugins.compress.qat.config import QuantSection

    return {"distill": DistillSection, "quant": QuantSection}


@hookimpl
def crosstrain_add_commands(subparsers: argparse._SubParsersAction) -> None:
    from crosstrain.plugins.compress.distill.cli import add_commands

    add_commands(subparsers)


@hookimpl(trylast=True)  # after MoE layers and LoRA adapters exist, so it sees the model that trains
def crosstrain_transform_model(model: Any, config: Any, name: str, trainable: bool) -> Any:
    from crosstrain.plugins.compress.qat.transform import transform

    return transform(model, config, name, trainable)


@hookimpl
def crosstrain_eval_variants(config: Any) -> dict[str, Any]:
    """Under ``quant.qat``: each evaluation also in floating point (``eval/fp/loss``), the cost of quantisation."""
    if config.section("quant").qat == "none":
        return {}
    from crosstrain.plugins.compress.qat.linear import fake_quant_disabled

    return {"fp": fake_quant_disabled}


@hookimpl
def crosstrain_report_panels() -> list[Any]:
    """The student's and the teacher's held-out NLL side by side, and the divergence, on ``crosstrain report``."""
    from crosstrain.plugins.observability.panels import Panel

    return [Panel("distill_nll", "Distillation: student vs teacher NLL", ("eval/nll/*", "nll/student"), "nats"),
            Panel("distill_kd", "Distillation divergence", ("kd", "eval/kd"), "divergence")]
