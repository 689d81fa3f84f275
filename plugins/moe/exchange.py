"""Expert-parallel agreement: before every token exchange the ep ranks all-gather what they are about to do
(layer, experts, capacity, rows per expert) under a timeout, so a disagreement is a one-line error naming the
layer instead of a hang inside the all-to-all (DeepSpeed #6809, #5794)."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from crosstrain.collective import served_device
from crosstrain.errors import CollectiveError

#: columns of the agreed table before the per-expert row counts
LAYER, EXPERTS, CAPACITY, HEADER = 0, 1, 2, 3


def agree(layer: str, layer_id: int, counts: torch.Tensor, capacity: int, group: Any,
          timeout_s: float) -> torch.Tensor:
    """All-gather ``[layer_id, experts, capacity, counts...]`` over ``group``; return the ``[ep, 3 + E]`` table.

    Raises :class:`CollectiveError` naming ``layer`` when the ranks do not answer within ``timeout_s`` or
    disagree on the layer, the number of experts or the capacity.
    """
    row = torch.cat([torch.tensor([layer_id, counts.numel(), capacity], dtype=torch.int64),
                     counts.detach().to("cpu", torch.int64).reshape(-1)])
    size = dist.get_world_size(group)
    # the row stays on the host where the group serves it: its async wait honours timeout_s there (simdev's simgloo
    # completes a device collective inside the call, so a rank that never arrives would block past the timeout)
    mine = row.to(served_device(row.device, group))
    # a size-tagged first exchange, so a rank with a different number of experts cannot hang the second one
    table = _gather(mine, size, group, timeout_s, layer).cpu()
    for col, what in ((LAYER, "the layer"), (EXPERTS, "the number of experts"), (CAPACITY, "the capacity")):
        values = table[:, col].tolist()
        if len(set(values)) > 1:
            got = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            fix = ("give every rank the same tokens per micro-batch or set moe.capacity_factor=0 (dropless)"
                   if col == CAPACITY else "build the same model with the same [moe] section on every rank")
            raise CollectiveError(f"moe layer {layer}: expert-parallel ranks disagree on {what} ({got}); {fix}")
    return table


def _gather(row: torch.Tensor, size: int, group: Any, timeout_s: float, layer: str) -> torch.Tensor:
    width = torch.tensor([row.numel()], dtype=torch.int64, device=row.device)
    widths = [torch.empty_like(width) for _ in range(size)]
    _wait(dist.all_gather(widths, width, group=group, async_op=True), timeout_s, layer)
    values = sorted({int(w) for w in widths})
    if len(values) > 1:
        raise CollectiveError(f"moe layer {layer}: expert-parallel ranks disagree on the number of experts "
                              f"({', '.join(str(v - HEADER) for v in values)}); build the same model with the "
                              "same [moe] section on every rank")
    rows = [torch.empty_like(row) for _ in range(size)]
    _wait(dist.all_gather(rows, row, group=group, async_op=True), timeout_s, layer)
    return torch.stack(rows)


def _wait(work: Any, timeout_s: float, layer: str) -> None:
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise CollectiveError(
            f"moe layer {layer}: the expert-parallel ranks did not agree on split sizes within {timeout_s:g}s "
            f"(a rank skipped this layer or stopped; {type(exc).__name__}); run the same layers on every rank or "
            "raise moe.exchange_timeout_s"
        ) from None
