"""A test plugin that makes chosen steps non-finite: recipe ``lm_nan`` is ``lm`` with a NaN loss (so NaN gradients)
at the steps given. ``plugin(NaNSteps({3}), "nan-at-3")`` then ``train.recipe=lm_nan``."""

from __future__ import annotations

from typing import Any

from crosstrain import hookimpl
from crosstrain.engine.recipe import MicroBatchLoss
from crosstrain.recipes.lm import LMRecipe


class NaNSteps:
    def __init__(self, steps: set[int] | None = None, *, first: int | None = None) -> None:
        self.steps = steps or set()
        self.first = first

    def bad(self, step: int) -> bool:
        return step in self.steps or (self.first is not None and step >= self.first)

    @hookimpl
    def crosstrain_recipe(self, name: str) -> Any:
        if name != "lm_nan":
            return None
        nan_steps = self

        class NaNRecipe(LMRecipe):
            name = "lm_nan"
            step = 0

            def prepare_step(self, micro_batches: list[Any], context: Any) -> list[Any]:
                self.step = context.step + 1  # the step about to run (after a rollback too)
                return micro_batches

            def loss(self, models: Any, batch: Any) -> MicroBatchLoss:
                out = super().loss(models, batch)
                return MicroBatchLoss(out.loss * float("nan")) if nan_steps.bad(self.step) else out

        return NaNRecipe()

    @hookimpl
    def crosstrain_recipe_names(self) -> list[str]:
        return ["lm_nan"]
