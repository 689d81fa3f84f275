"""Differentiable all-to-all with uneven splits, for expert-parallel token dispatch and combine.

The backward of an all-to-all is the reverse all-to-all: the gradient of the rows this rank received from
rank ``j`` goes back to ``j``, so backward exchanges with the splits swapped (as in Megatron-LM's
``_AllToAll`` and torchtitan's expert-parallel dispatch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from crosstrain.errors import CollectiveError


def _group_size(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _exchange(tensor: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any) -> torch.Tensor:
    out = tensor.new_empty((sum(output_splits), *tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes=output_splits,
                           input_split_sizes=input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, output_splits: list[int], input_splits: list[int],
                group: Any) -> torch.Tensor:
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        return _exchange(tensor, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        output_splits, input_splits = ctx.splits
        return _exchange(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all_autograd(tensor: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int],
                        group: Any = None) -> torch.Tensor:
    """Send ``input_splits[i]`` rows (dim 0) of ``tensor`` to rank ``i`` of ``group``; receive
    ``output_splits[j]`` rows from rank ``j``, concatenated in rank order. Differentiable in ``tensor``.

    ``group`` is a process group (``ep_mesh.get_group()``; None = the world). The splits must already agree
    across ranks (see :func:`exchange_splits`). Without a process group, or in a group of one, it is the identity.
    """
    outs, ins = [int(s) for s in output_splits], [int(s) for s in input_splits]
    size = _group_size(group)
    if len(ins) != size or len(outs) != size:
        raise CollectiveError(f"all_to_all: {len(ins)} input and {len(outs)} output splits for a group of {size}; "
                              "pass one split per rank")
    if sum(ins) != tensor.shape[0]:
        raise CollectiveError(f"all_to_all: input splits sum to {sum(ins)} but the tensor has {tensor.shape[0]} "
                              "rows; make the splits add up to the rows sent")
    if size == 1:
        return tensor
    return _AllToAll.apply(tensor, outs, ins, group)


def exchange_splits(input_splits: Sequence[int] | torch.Tensor, group: Any = None,
                    device: torch.device | None = None) -> list[int]:
    """Tell each rank how many rows it gets from this one; return how many this rank gets from each.

    A small all-to-all of counts (int64, on ``device``, or on the tensor's device when ``input_splits`` is a
    tensor), then one host sync to read them.
    """
    if isinstance(input_splits, torch.Tensor):
        send = input_splits.to(dtype=torch.int64).reshape(-1)
    else:
        send = torch.tensor([int(s) for s in input_splits], dtype=torch.int64, device=device)
    size = _group_size(group)
    if send.numel() != size:
        raise CollectiveError(f"all_to_all: {send.numel()} input splits for a group of {size}; pass one per rank")
    if size == 1:
        return [int(v) for v in send.tolist()]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return [int(v) for v in recv.tolist()]


def all_to_all_uneven_autograd(tensor: torch.Tensor, input_splits: Sequence[int] | torch.Tensor,
                               group: Any = None) -> tuple[torch.Tensor, list[int]]:
    """:func:`all_to_all_autograd` after agreeing the splits; returns ``(received rows, output_splits)``.

    Keep ``output_splits`` to send the results back: ``all_to_all_autograd(y, input_splits, output_splits, group)``.
    """
    ins = [int(s) for s in (input_splits.tolist() if isinstance(input_splits, torch.Tensor) else input_splits)]
    outs = exchange_splits(ins, group, device=tensor.device)
    return all_to_all_autograd(tensor, outs, ins, group), outs
