"""The full (unsharded) model state on every rank, with the plain single-process GPT's parameter names."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

#: wrapper prefixes that FSDP1/DDP/compile/activation checkpointing add to parameter names.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def clean_name(name: str, ddp: bool = False) -> str:
    """``module.layers.0._checkpoint_wrapped_module.attention.wq.weight`` -> ``layers.0.attention.wq.weight``."""
    if ddp and name.startswith("module."):
        name = name[len("module."):]
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


class _ErrorsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


_ERRORS_ONLY = _ErrorsOnly()


@contextlib.contextmanager
def quiet_redistribute() -> Iterator[None]:
    """Silence DTensor's per-call warning that a 2-D redistribution takes two collectives (FSDP x TP). A filter,
    not ``setLevel``: that clears the level cache of every logger, ~0.4 ms a call, and this runs twice a step."""
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    added = _ERRORS_ONLY not in log.filters
    log.addFilter(_ERRORS_ONLY)
    try:
        yield
    finally:
        if added:
            log.removeFilter(_ERRORS_ONLY)


def local_full_state(module: nn.Module, ddp: bool = False) -> dict[str, torch.Tensor]:
    """This stage's state with DTensors gathered (a collective over their meshes), as fp32 CPU tensors."""
    out: dict[str, torch.Tensor] = {}
    with quiet_redistribute():
        for name, tensor in module.state_dict().items():
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()
            tensor = tensor.detach()
            if tensor.is_floating_point():
                tensor = tensor.to(torch.float32)
            out[clean_name(name, ddp)] = tensor.cpu().clone()
    return out


def gather_pipeline_state(local: dict[str, torch.Tensor], pp_group: Any,
                          comm_device: torch.device) -> dict[str, torch.Tensor]:
    """Merge every pipeline stage's state so each rank holds the whole model (names are disjoint)."""
    size = dist.get_world_size(pp_group)
    meta = {name: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in local.items()}
    metas: list[Any] = [None] * size
    dist.all_gather_object(metas, meta, group=pp_group)
    me = dist.get_rank(pp_group)
    merged: dict[str, torch.Tensor] = {}
    for stage, stage_meta in enumerate(metas):
        for name in sorted(stage_meta):
            shape, dtype = stage_meta[name]
            if stage == me:
                buf = local[name].to(comm_device)
            else:
                buf = torch.empty(shape, dtype=getattr(torch, dtype), device=comm_device)
            dist.broadcast(buf, group_src=stage, group=pp_group)
            merged[name] = buf.cpu() if stage != me else local[name]
    return dict(sorted(merged.items()))
