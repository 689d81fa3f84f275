"""Sharded models during generation: what is gathered, once per :func:`generate` call.

- FSDP2 (``fully_shard``): every FSDP module is unsharded once on entry (one all-gather per parameter group,
  following its ``MixedPrecisionPolicy``) and resharded on exit. Generation calls the protocol methods, not
  ``module(...)``, so FSDP's per-forward hooks never run and decoding does no collective at all. Memory: one
  full copy of the parameters per rank (in the policy's ``param_dtype``) on top of the shards, for the whole call.
- Tensor parallelism: nothing is gathered. Parameters stay DTensors and the plans' module hooks do the usual
  per-layer collectives every step; the cache holds each rank's ``kv_heads / tp`` heads. Every rank of a TP
  group must pass the same prompts and an identically seeded generator (they share one batch anyway).
- DDP: the wrapped module is used directly (parameters are already whole).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import cast

import torch
from torch import nn

from crosstrain.parallel.local import local_tensor


def unwrap(model: nn.Module) -> nn.Module:
    """The module that implements the cache protocol (DDP's ``.module``, torch.compile's ``_orig_mod``)."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and not hasattr(model, "forward_cached"):
            model = cast(nn.Module, model._orig_mod)
        else:
            return model


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Unshard every FSDP2 module of ``model`` for the duration of the block (no-op for unsharded models)."""
    from torch.distributed.fsdp import FSDPModule

    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in fsdp:
        m.unshard()
    try:
        yield
    finally:
        for m in fsdp:
            m.reshard()


def model_device(model: nn.Module) -> torch.device:
    """Where the model computes: its first parameter's (local shard's) device, else CPU."""
    for p in model.parameters():
        return local_tensor(p).device
    return torch.device("cpu")
