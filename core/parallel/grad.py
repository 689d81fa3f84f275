"""Gradient layout, norm and clipping that are correct under FSDP, TP (DTensor gradients) and PP (stage-local
grads)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from crosstrain.parallel.state import quiet_redistribute


def align_grads_(params: Iterable[torch.Tensor]) -> int:
    """Give every DTensor gradient its parameter's mesh and placements; returns how many were redistributed.

    Autograd leaves a DTensor parameter's gradient in whatever layout the backward produced: a vocab-sharded
    embedding (``Shard(0)``) behind a replicated-input plan gets a ``Replicate()`` (or ``Partial()``) gradient.
    ``torch.optim`` copes through DTensor's implicit redistribution, but an optimizer that steps each rank's
    local shard (the fused native kernels, the host-offload optimizer) needs the gradient's shard to be the
    parameter's. Doing it once here, before anything reads the gradients, serves every optimizer. ``Replicate``
    to ``Shard`` is a local slice; ``Partial`` becomes a reduce-scatter, the reduction it needed anyway.
    """
    moved = 0
    pairs = [(p, p.grad) for p in params if isinstance(p, DTensor) and isinstance(p.grad, DTensor)]
    if not pairs:  # plain tensors (one process, DDP): nothing to move, and no logger filter to set every step
        return 0
    with quiet_redistribute():
        for p, g in pairs:
            if g.device_mesh != p.device_mesh or tuple(g.placements) != tuple(p.placements):
                p.grad = g.redistribute(p.device_mesh, p.placements)
                moved += 1
    return moved


def _group_grads(params: Iterable[torch.Tensor]) -> dict[Any, list[torch.Tensor]]:
    """Gradients grouped by (mesh, placements) for DTensors; plain tensors under the key ``None``."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    return groups


def total_grad_norm(params: Iterable[torch.Tensor], pp_group: Any = None,
                    device: torch.device | None = None) -> torch.Tensor:
    """The global L2 norm of all gradients, identical on every rank (fp32 scalar on the grads' device).

    Sharded DTensor gradients are reduced with ``full_tensor()`` per (mesh, placements) group (replicated
    ones are counted once); with pipeline parallelism the squared norms of the stages are summed over the
    ``pp_group``.
    """
    return _total_norm(_group_grads(params), pp_group, device)


def _total_norm(groups: dict[Any, list[torch.Tensor]], pp_group: Any = None,
                device: torch.device | None = None) -> torch.Tensor:
    squares: list[torch.Tensor] = []
    with quiet_redistribute() if any(key is not None for key in groups) else contextlib.nullcontext():
        for grads in groups.values():
            norm = torch.nn.utils.get_total_norm(grads, 2.0)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            squares.append(norm.float().pow(2))
    if len(squares) == 1:  # the sum of one element, bit for bit, without a stack and a reduction a step
        total_sq = squares[0]
    elif squares:
        total_sq = torch.stack([s.to(squares[0].device) for s in squares]).sum()
    else:
        total_sq = torch.zeros((), dtype=torch.float32, device=device)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        if device is not None:
            total_sq = total_sq.to(device)
        dist.all_reduce(total_sq, group=pp_group)
    return total_sq.sqrt()


def clip_coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor clipping multiplies gradients by, ``min(1, max_norm / (norm + 1e-6))`` (torch.nn.utils'
    ``clip_grad_norm_``), an fp32 scalar on ``total``'s device."""
    return (float(max_norm) / (total + 1e-6)).clamp(max=1.0)


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, pp_group: Any = None,
                    device: torch.device | None = None) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most ``max_norm``; return the norm before clipping.

    ``max_norm <= 0`` only measures the norm.
    """
    groups = _group_grads(params)
    total = _total_norm(groups, pp_group, device)
    if max_norm is None or max_norm <= 0:
        return total
    coef = clip_coefficient(total, max_norm)
    for grads in groups.values():
        c = coef.to(grads[0].device)
        torch._foreach_mul_(grads, c)
    return total
