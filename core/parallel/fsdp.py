"""Data parallelism: FSDP2 ``fully_shard`` (HSDP on a 2-D mesh) and DDP, torch-native."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

#: precision name -> parameter compute dtype (reductions always in fp32).
PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def apply_fsdp(model: nn.Module, dp_mesh: Any, *, precision: str = "fp32", reshard_after_forward: bool = True) -> None:
    """Shard every block, then the rest (embeddings, norm, head) as the root group, in place.

    Parameters stay fp32 (the master copy, sharded); with ``precision`` bf16/fp16 they are all-gathered in
    that dtype for compute and gradients are reduced in fp32 (``MixedPrecisionPolicy``). A 2-D ``dp_mesh``
    (dp_replicate x dp_shard) gives HSDP.
    """
    # Blocks return their (k, v) cache as views; nothing modifies them in place, so FSDP's warning is noise.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    param_dtype = PARAM_DTYPES[precision]
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    layers = getattr(model, "layers", None)
    if layers is not None:
        for block in layers.values():
            fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)


def apply_ddp(model: nn.Module, dp_mesh: Any, device: torch.device) -> nn.Module:
    """Wrap ``model`` in ``DistributedDataParallel`` on the 1-D replicate mesh's process group."""
    device_ids = None if device.type == "cpu" else [device]
    # buffers (rope tables) are deterministic: do not re-broadcast them every forward
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        sync: dict[str, Any] = {"forward_sync_buffers": False}
    else:  # torch < 2.12
        sync = {"broadcast_buffers": False}
    return DistributedDataParallel(model, device_ids=device_ids, process_group=dp_mesh.get_group(), **sync)
