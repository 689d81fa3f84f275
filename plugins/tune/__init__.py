"""Hyperparameter search on Optuna: ``crosstrain tune`` (docs/tune.md)."""
