"""An example crosstrain recipe plugin: ``crosstrain train --recipe lm_kl`` (see docs/recipes.md)."""
