"""One micro-batch of a recipe: forward (the recipe's loss plus auxiliary losses), backward, and the mean of
the loss and the recipe's metrics over data-parallel ranks (one async all-reduce overlapping the backward)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from crosstrain.engine.aux_loss import collect_aux_losses, collect_metrics
from crosstrain.engine.models import TrainedModel
from crosstrain.engine.recipe import MicroBatchLoss, Recipe
from crosstrain.errors import CrosstrainError, PluginError


def to_device(batch: Any, device: torch.device) -> Any:
    """Move a batch (a tensor, a dataclass such as :class:`~crosstrain.data.batch.TokenBatch`, or a
    tuple/list/dict of them) to ``device`` without blocking."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: to_device(getattr(batch, f.name), device)
                                             for f in dataclasses.fields(batch) if f.init})
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def _as_tensor(value: Any, like: torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    return torch.tensor(float(value), device=like.device)


def _check(out: Any, recipe: Recipe) -> MicroBatchLoss:
    if not isinstance(out, MicroBatchLoss) or not isinstance(out.loss, torch.Tensor) or out.loss.numel() != 1:
        raise PluginError(f"recipe {recipe.name!r} loss() must return MicroBatchLoss(loss=<scalar tensor>, ...)")
    return out


def forward_backward(recipe: Recipe, models: Mapping[str, TrainedModel], primary: TrainedModel, batch: Any, *,
                     scale: float, divisor: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
    """Forward and backward of one micro-batch; gradients accumulate ``(loss + aux) * scale / divisor``.

    Returns the mean loss (the same on every rank), the mean of each recipe metric, auxiliary loss
    (``aux/<name>``) and module metric (:func:`crosstrain.engine.aux_loss.add_metric`), and timings
    (``forward_s``, ``backward_s``, ``comm_s``).
    """
    pm = primary.parallel
    if pm.schedule is not None:  # pipeline parallel: the schedule runs forward and backward with the loss bound in
        with collect_aux_losses() as aux:
            loss, timings = pm.forward_backward(*recipe.pipeline_batch(batch), scale=scale, divisor=divisor)
        if aux:
            raise CrosstrainError(f"auxiliary losses ({', '.join(aux)}) are not supported with parallel.pp > 1; "
                                  "set parallel.pp=1")
        return loss, {}, timings
    modules = {name: m.module for name, m in models.items()}
    now = pm.now  # synchronises the device around timed regions when asked
    with contextlib.ExitStack() as stack:
        for m in models.values():
            if m.trainable:
                stack.enter_context(m.parallel.no_sync())
        t0 = now()
        with pm.autocast(), collect_aux_losses() as aux, collect_metrics() as module_metrics:
            out = _check(recipe.loss(modules, batch), recipe)
        total = out.loss
        for term in aux.values():
            total = total + term
        t1 = now()
        names = ["loss", *(f"aux/{k}" for k in aux), *out.metrics, *module_metrics]
        values = [out.loss, *aux.values(), *(_as_tensor(v, out.loss) for v in out.metrics.values()),
                  *(v.to(out.loss.device) for v in module_metrics.values())]
        # one all-reduce for the loss and every metric, overlapping the backward
        reduction = pm.start_loss_reduce(torch.stack([v.detach().float().reshape(()) for v in values]))
        (total * (scale / divisor)).backward()
        t2 = now()
    means = pm.finish_loss_reduce(reduction)
    t3 = now()
    metrics = {name: means[i] for i, name in enumerate(names) if i}
    return means[0], metrics, {"forward_s": t1 - t0, "backward_s": t2 - t1, "comm_s": t3 - t2}

