"""The vision plugin's hooks (thin: the work is in :mod:`crosstrain.plugins.vision.data` and the recipes'
packages): the image recipes, the ``[vision]``, ``[classify]`` and ``[detect]`` sections, and the report panels of
their metrics. One recipe per line in ``RECIPES`` and in :func:`crosstrain_recipe`."""

from __future__ import annotations

from typing import Any

from crosstrain import hookimpl

RECIPES = (
    "classify",
    "detect",
)


@hookimpl
def crosstrain_recipe(name: str) -> Any:
    if name == "classify":
        from crosstrain.plugins.vision.classify.recipe import ClassifyRecipe

        return ClassifyRecipe()
    if name == "detect":
        from crosstrain.plugins.vision.detect.recipe import DetectRecipe

        return DetectRecipe()
    return None


@hookimpl
def crosstrain_recipe_names() -> list[str]:
    return list(RECIPES)


@hookimpl
def crosstrain_config_sections() -> dict[str, type]:
    from crosstrain.plugins.vision.config import ClassifySection, VisionSection
    from crosstrain.plugins.vision.detect.config import DetectSection

    return {
        "vision": VisionSection,
        "classify": ClassifySection,
        "detect": DetectSection,
    }


@hookimpl
def crosstrain_report_panels() -> list[Any]:
    """Held-out accuracy and per-class recall (``classify``), COCO mAP (``detect``) on ``crosstrain report``."""
    from crosstrain.plugins.observability.panels import Panel

    return [Panel("classify_accuracy", "Classification accuracy", ("eval/top1", "eval/top5", "top1"), "accuracy"),
            Panel("classify_recall", "Per-class recall (held out)", ("eval/recall/*",), "recall"),
            Panel("detect_map", "Detection: held-out COCO mAP", ("eval/map", "eval/map_50"), "AP")]


@hookimpl
def crosstrain_refusal_rules() -> list[Any]:
    from crosstrain.plugins.vision.rules import RULES

    return list(RULES)
