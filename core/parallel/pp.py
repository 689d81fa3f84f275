"""Pipeline parallelism through ``torch.distributed.pipelining`` with a manual stage split (torchtitan style).

Stage ``s`` of ``pp`` keeps a contiguous run of ``model.layers`` (earlier stages take the remainder) and
drops what it does not own: ``tok_embeddings`` lives on the first stage, ``norm`` and ``output`` on the last,
so ``GPT.forward`` maps tokens -> hidden -> ... -> logits across stages. Keys of the ``ModuleDict`` keep
their global index, so parameter names match the plain model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from crosstrain.errors import ConfigError

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def stage_layers(n_layers: int, pp: int, stage: int) -> list[int]:
    """Global block indices owned by ``stage`` (contiguous, sizes differ by at most one)."""
    base, extra = divmod(n_layers, pp)
    start = stage * base + min(stage, extra)
    count = base + (1 if stage < extra else 0)
    return list(range(start, start + count))


def split_stage(model: nn.Module, pp: int, stage: int) -> nn.Module:
    """Turn ``model`` (in place) into pipeline stage ``stage`` of ``pp`` and return it."""
    layers = cast(nn.ModuleDict, model.layers)
    keys = list(layers.keys())
    keep = {keys[i] for i in stage_layers(len(keys), pp, stage)}
    for key in keys:
        if key not in keep:
            del layers[key]
    if stage != 0:
        setattr(model, "tok_embeddings", None)  # noqa: B010 (nn.Module attribute typing)
    if stage != pp - 1:
        setattr(model, "norm", None)  # noqa: B010
        setattr(model, "output", None)  # noqa: B010
    return model


def build_schedule(stage_module: nn.Module, stage: int, pp: int, device: torch.device, pp_group: Any, *,
                   schedule: str, microbatches: int, loss_fn: Callable[..., torch.Tensor]) -> Any:
    """A ``PipelineStage`` and a single-stage schedule (GPipe or 1F1B) over ``microbatches``.

    Gradients are not rescaled by the schedule (``scale_grads=False``): ``loss_fn`` divides by the number of
    micro-batches itself, so gradient accumulation across ``step`` calls stays correct.
    """
    name = str(schedule).lower()
    if name not in SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule={schedule!r} is not allowed; use one of {', '.join(SCHEDULES)}")
    if microbatches < 1:
        raise ConfigError(f"pipeline micro-batches={microbatches} must be >= 1")
    if name == "1f1b" and microbatches < pp:
        raise ConfigError(f"parallel.pp_schedule=1f1b needs at least pp={pp} micro-batches, got {microbatches}")
    pipe_stage = PipelineStage(stage_module, stage, pp, device, group=pp_group)
    return SCHEDULES[name](pipe_stage, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
