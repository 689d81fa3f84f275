"""Evaluation over a recipe's held-out samples, under any parallel layout, without touching training state.

Batches are taken in order (no RNG, no sampler), ``batch_size`` sequences each, split across data-parallel
ranks like a training step; the models run in eval mode under ``torch.no_grad()``; losses and metrics are
averaged over data-parallel ranks and then over batches, so every layout reports what one process would.
Perplexity is ``exp(loss)`` of the mean token cross-entropy (nats), reported only for a recipe whose loss is
one (``Recipe.loss_is_token_nll``): of a DPO or distillation loss it would be a meaningless figure.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping

import numpy as np
import torch

from crosstrain.engine.models import TrainedModel
from crosstrain.engine.recipe import Recipe, RecipeDataset
from crosstrain.engine.step import to_device
from crosstrain.errors import ConfigError


def eval_batches(num_samples: int, batch_size: int, max_batches: int) -> int:
    """How many full eval batches one evaluation runs (``max_batches`` 0: the whole split)."""
    full = num_samples // batch_size
    return min(full, max_batches) if max_batches else full


def check_eval(num_samples: int, batch_size: int, dp_size: int, microbatches: int) -> None:
    """One-line errors for eval settings that cannot run on this data and layout."""
    unit = dp_size * microbatches  # every data-parallel rank (and pipeline micro-batch) takes a share
    if batch_size % unit:
        raise ConfigError(f"eval.batch_size={batch_size} must be divisible by the data-parallel degree ({dp_size})"
                          + (f" x pipeline micro-batches ({microbatches})" if microbatches > 1 else "")
                          + "; change eval.batch_size")
    if num_samples < batch_size:
        fits = num_samples // unit * unit
        fix = f"set eval.batch_size={fits}" if fits else "hold out more data"
        raise ConfigError(f"the validation data has {num_samples} samples, fewer than eval.batch_size={batch_size}; "
                          f"{fix} or raise data.val_fraction")


def fit_eval_batch(num_samples: int, batch_size: int, explicit: bool, dp_size: int,
                   microbatches: int) -> tuple[int, str]:
    """The eval batch size for ``num_samples`` held-out samples, and a one-line notice when it differs.

    ``batch_size`` inherited from ``train.batch_size`` (``explicit`` False) shrinks to the largest multiple of
    ``dp_size x microbatches`` that the data fills, so a small dataset (15 held-out preference rows under a
    batch of 16) still evaluates; an ``eval.batch_size`` the user set is kept or refused (:func:`check_eval`).
    """
    unit = dp_size * microbatches
    fits = num_samples // unit * unit
    if explicit or num_samples >= batch_size or not fits:
        check_eval(num_samples, batch_size, dp_size, microbatches)
        return batch_size, ""
    return fits, (f"crosstrain: eval batch {batch_size} -> {fits}: the validation data has only {num_samples} "
                  f"samples (set eval.batch_size to choose another)")


@torch.no_grad()
def evaluate(recipe: Recipe, models: Mapping[str, TrainedModel], primary: TrainedModel, dataset: RecipeDataset, *,
             batch_size: int, max_batches: int, dp_rank: int, dp_size: int, device: torch.device) -> dict[str, float]:
    """``eval/loss``, ``eval/perplexity`` (token-NLL recipes), ``eval/<metric>`` (means over batches, then the
    recipe's ``eval_metrics()`` over the whole split) and ``time_eval_s`` (the same on every rank)."""
    start = time.perf_counter()
    pm = primary.parallel
    modules = {name: m.module for name, m in models.items()}
    was_training = {name: m.module.training for name, m in models.items()}
    for m in models.values():
        m.module.eval()
    per_rank = batch_size // dp_size
    sums: torch.Tensor | None = None
    names: list[str] = ["loss"]
    n = eval_batches(len(dataset), batch_size, max_batches)
    try:
        for b in range(n):
            first = b * batch_size + dp_rank * per_rank
            batch = to_device(dataset.batch(np.arange(first, first + per_rank)), device)
            if pm.schedule is not None:
                values = pm.eval_loss(*recipe.pipeline_batch(batch)).reshape(1)
            else:
                with pm.autocast():
                    out = recipe.eval_loss(modules, batch)
                names = ["loss", *out.metrics]
                parts = [out.loss, *(torch.as_tensor(v, device=out.loss.device) for v in out.metrics.values())]
                values = pm.finish_loss_reduce(pm.start_loss_reduce(torch.stack(
                    [v.detach().float().reshape(()) for v in parts])))
            sums = values if sums is None else sums + values
    finally:
        for name, m in models.items():
            m.module.train(was_training[name])
    if sums is None:
        return {}
    means = (sums / n).tolist()
    result = {f"eval/{name}": value for name, value in zip(names, means, strict=True)}
    result.update(recipe.eval_metrics(result))
    if recipe.loss_is_token_nll:
        loss = result["eval/loss"]
        result["eval/perplexity"] = math.exp(loss) if loss < 700 else float("inf")
    result["time_eval_s"] = time.perf_counter() - start
    return result


@torch.no_grad()
def eval_predictions(recipe: Recipe, models: Mapping[str, TrainedModel], primary: TrainedModel, dataset: RecipeDataset,
                     *, batch_size: int, max_batches: int, device: torch.device) -> list[dict[str, object]]:
    """The recipe's per-sample predictions (``Recipe.eval_predictions``) over the batches :func:`evaluate` takes, in
    order, one process; each row gets ``index``, the sample's position in the held-out split."""
    modules = {name: m.module for name, m in models.items()}
    was_training = {name: m.module.training for name, m in models.items()}
    for m in models.values():
        m.module.eval()
    rows: list[dict[str, object]] = []
    try:
        for b in range(eval_batches(len(dataset), batch_size, max_batches)):
            batch = to_device(dataset.batch(np.arange(b * batch_size, (b + 1) * batch_size)), device)
            with primary.parallel.autocast():
                found = recipe.eval_predictions(modules, batch)
            if found is None:
                raise ConfigError(f"--recipe {recipe.name} has no per-sample predictions; drop --predictions")
            rows += [{"index": b * batch_size + i, **row} for i, row in enumerate(found)]
    finally:
        for name, m in models.items():
            m.module.train(was_training[name])
    return rows
