"""Inside a trial's run: rank 0 reports each evaluation to the study and asks its pruner; a prune decision is a
``request_stop``, so every rank stops together at the next stop vote, saves a checkpoint and exits 0
(docs/recipes.md, the stop vote). Works under every layout because only rank 0 talks to the study: the eval
values are the same on every rank (crosstrain.engine.evaluate averages them over data-parallel ranks)."""

from __future__ import annotations

import math
from typing import Any

#: trial user attr: the step at which the pruner stopped the trial (so a tuner resuming it does not retrain it)
PRUNED_AT = "pruned_at_step"

_trials: dict[tuple[str, str, int], Any] = {}


def _trial(config: Any) -> Any:
    section = config.section("tune")
    key = (section.storage, section.study, section.trial)
    if key not in _trials:
        import optuna

        from crosstrain.plugins.tune.study import make_pruner, open_storage

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        pruner = make_pruner(section, config.train.steps, config.eval.every or config.train.steps)
        loaded = optuna.load_study(study_name=section.study, storage=open_storage(section.storage), pruner=pruner)
        _trials[key] = optuna.trial.Trial(loaded, section.trial)
    return _trials[key]


def report(context: Any, step: int, metrics: dict[str, float]) -> bool:
    """Report ``tune.intermediate`` at ``step`` (rank 0, eval steps only); returns whether the trial was pruned."""
    section = context.config.section("tune")
    value = metrics.get(section.intermediate)
    if section.trial < 0 or not context.is_main or value is None or not math.isfinite(value):
        return False
    import warnings

    trial = _trial(context.config)
    with warnings.catch_warnings():  # a resumed trial re-reports a step it reported before: Optuna keeps the first
        warnings.simplefilter("ignore")
        trial.report(float(value), step)
    if step >= context.config.train.steps or not trial.should_prune():  # at its last step the trial has finished
        return False
    trial.set_user_attr(PRUNED_AT, step)
    context.emit_event("tune_pruned", f"crosstrain: trial pruned at step {step} ({section.intermediate} "
                       f"{value:.4f}); stopping", trial=section.trial)
    context.request_stop("pruned by crosstrain tune")
    return True
