"""Built-in recipes: ``lm`` (next-token pretraining, the default). Plugins add more (see docs/recipes.md)."""

from crosstrain.recipes.lm import LMRecipe, build_model

__all__ = ["LMRecipe", "build_model"]
