"""The process-local part of a possibly sharded tensor."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The process-local tensor of a DTensor (an FSDP2/TP/EP shard, sharing its storage; differentiable), or
    ``t`` itself. Element-wise updates on it (optimizer steps) touch this rank's shard only, as torch.optim does
    on DTensors."""
    return t.to_local() if isinstance(t, DTensor) else t
