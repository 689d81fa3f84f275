"""Pipeline parallelism through ``torch.distributed.pipelining`` with a manual stage split (torchtitan style).

The model splits itself: its ``pipeline_split(pp, stage)`` (a method, or registered with
:func:`crosstrain.parallel.register_parallel_plan`) keeps what stage ``stage`` owns, so that ``forward`` maps
the previous stage's output to the next stage's input, and keeps parameter names those of the full model.
:func:`stage_layers` is the usual contiguous split of a stack of blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from crosstrain.errors import ConfigError
from crosstrain.parallel.plan import find_plan, missing_plan

#: the schedules ``parallel.pp_schedule`` names (``torch.distributed.pipelining`` is imported only when a pipeline
#: is built: it pulls in dynamo, over a second of every worker's start-up otherwise)
SCHEDULES = ("gpipe", "1f1b")


def stage_layers(n_layers: int, pp: int, stage: int) -> list[int]:
    """Global block indices owned by ``stage`` (contiguous, sizes differ by at most one)."""
    base, extra = divmod(n_layers, pp)
    start = stage * base + min(stage, extra)
    count = base + (1 if stage < extra else 0)
    return list(range(start, start + count))


def split_stage(model: nn.Module, pp: int, stage: int) -> nn.Module:
    """Turn ``model`` (in place) into pipeline stage ``stage`` of ``pp`` through its plan and return it."""
    split = find_plan(model, "pipeline_split")
    if split is None:
        raise missing_plan(model, "pipeline_split", f"parallel.pp={pp}", "parallel.pp=1")
    split(pp, stage)
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
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    schedule_class = ScheduleGPipe if name == "gpipe" else Schedule1F1B
    pipe_stage = PipelineStage(stage_module, stage, pp, device, group=pp_group)
    return schedule_class(pipe_stage, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
