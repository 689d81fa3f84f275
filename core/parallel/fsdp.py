"""Data parallelism: FSDP2 ``fully_shard`` (HSDP on a 2-D mesh) and DDP, torch-native."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

#: precision name -> parameter compute dtype (reductions always in fp32).
PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def apply_fsdp(model: nn.Module, dp_mesh: Any, *, precision: str = "fp32", reshard_after_forward: bool = True,
               units: Iterable[str] = ()) -> None:
    """Shard each block unit (dotted paths inside ``model``), then the rest as the root group, in place.

    Parameters stay fp32 (the master copy, sharded); with ``precision`` bf16/fp16 they are all-gathered in
    that dtype for compute and gradients are reduced in fp32 (``MixedPrecisionPolicy``). A 2-D ``dp_mesh``
    (dp_replicate x dp_shard) gives HSDP.
    """
    # Blocks return their (k, v) cache as views; nothing modifies them in place, so FSDP's warning is noise.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    param_dtype = PARAM_DTYPES[precision]
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for path in units:
        fully_shard(model.get_submodule(path), mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)


def expert_dp_mesh(mesh: Any, dims: Any) -> Any:
    """The ranks that hold the same experts when ``ep > 1``: ``dp_shard_out``, or ``(dp_replicate, dp_shard_out)``."""
    return mesh["dp_shard_out"] if dims.dp_replicate == 1 else mesh["dp_replicate", "dp_shard_out"]


def apply_expert_fsdp(modules: Iterable[nn.Module], expert_mesh: Any, dp_degree: int, *, precision: str = "fp32",
                      reshard_after_forward: bool = True) -> None:
    """Shard each expert-parallel module on its own data-parallel mesh (torchtitan's ``dp_mod_ep``), in place.

    Call before :func:`apply_fsdp`, whose groups then leave these parameters alone. An expert's gradient already
    sums the tokens of all ``ep`` ranks (the all-to-all backward brings them), so the reduction over
    ``expert_mesh`` divides by the whole data-parallel degree, not by that mesh's size.
    """
    mp = MixedPrecisionPolicy(param_dtype=PARAM_DTYPES[precision], reduce_dtype=torch.float32)
    for module in modules:
        fully_shard(module, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        cast(FSDPModule, module).set_gradient_divide_factor(float(dp_degree))


def apply_ddp(model: nn.Module, dp_mesh: Any, device: torch.device) -> nn.Module:
    """Wrap ``model`` in ``DistributedDataParallel`` on the 1-D replicate mesh's process group."""
    device_ids = None if device.type == "cpu" else [device]
    # buffers (rope tables) are deterministic: do not re-broadcast them every forward
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        sync: dict[str, Any] = {"forward_sync_buffers": False}
    else:  # torch < 2.12
        sync = {"broadcast_buffers": False}
    return DistributedDataParallel(model, device_ids=device_ids, process_group=dp_mesh.get_group(), **sync)
