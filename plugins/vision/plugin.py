"""The vision plugin's hooks (thin: the work is in :mod:`crosstrain.plugins.vision.detect`): the ``detect`` recipe,
its ``[detect]`` section and the report panel of its COCO metrics."""

from __future__ import annotations

from typing import Any

from crosstrain import hookimpl

RECIPES = ("detect",)


@hookimpl
def crosstrain_recipe(name: str) -> Any:
    if name == "detect":
        from crosstrain.plugins.vision.detect.recipe import DetectRecipe

        return DetectRecipe()
    return None


@hookimpl
def crosstrain_recipe_names() -> list[str]:
    return list(RECIPES)


@hookimpl
def crosstrain_config_sections() -> dict[str, type]:
    from crosstrain.plugins.vision.detect.config import DetectSection

    return {"detect": DetectSection}


@hookimpl
def crosstrain_report_panels() -> list[Any]:
    """Held-out COCO mAP of ``--recipe detect`` on ``crosstrain report``."""
    from crosstrain.plugins.observability.panels import Panel

    return [Panel("detect_map", "Detection: held-out COCO mAP", ("eval/map", "eval/map_50"), "AP")]
