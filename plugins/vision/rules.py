"""The combinations the vision plugin refuses (``crosstrain_refusal_rules``; the table is
:mod:`crosstrain.config.rules`). Pipeline parallelism needs no rule here: the image recipes do not declare
``supports_pipeline``, which the core's ``pp-recipe`` rule reads."""

from __future__ import annotations

from crosstrain.config.rules import Rule

#: the image recipes: data-parallel layouts only (their models bring no tensor-parallel plan)
IMAGE_RECIPES = ("classify",)

RULES = (
    Rule("vision-dp", "vision", "an image recipe (classify) with `parallel.tp > 1` or `parallel.ep > 1`",
         "set parallel.tp=1 and parallel.ep=1 (dp_replicate and dp_shard train it)",
         lambda c, d: c.train.recipe in IMAGE_RECIPES and (d.tp > 1 or d.ep > 1),
         lambda c, d: f"--recipe {c.train.recipe} trains data-parallel only, not parallel.tp={d.tp} x "
                      f"parallel.ep={d.ep}"),
)
