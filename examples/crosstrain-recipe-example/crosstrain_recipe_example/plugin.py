"""The plugin's hooks: the ``lm_kl`` recipe and its ``[lm_kl]`` config section."""

from __future__ import annotations

from typing import Any

from crosstrain import hookimpl


@hookimpl
def crosstrain_recipe(name: str) -> Any:
    if name == "lm_kl":
        from crosstrain_recipe_example.recipe import LMKLRecipe

        return LMKLRecipe()
    return None


@hookimpl
def crosstrain_recipe_names() -> list[str]:
    return ["lm_kl"]


@hookimpl
def crosstrain_config_sections() -> dict[str, type]:
    from crosstrain_recipe_example.config import LMKLSection

    return {"lm_kl": LMKLSection}
