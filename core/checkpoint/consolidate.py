"""Full (unsharded) model tensors from a sharded checkpoint, in one process, and export to one safetensors file."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from crosstrain.checkpoint.atomic import atomic_path
from crosstrain.checkpoint.dcp import read_meta
from crosstrain.checkpoint.resolve import CHECKPOINT, Resolved, resolve_path
from crosstrain.checkpoint.safe_io import SafeFileSystemReader, SafeLoadPlanner, call_dcp, read_metadata
from crosstrain.checkpoint.verify import verify
from crosstrain.errors import CheckpointError


def load_consolidated(path: str | os.PathLike[str] | Resolved, *, check: bool = True) -> dict[str, torch.Tensor]:
    """Model tensors of the checkpoint at ``path`` (a run dir, its ``checkpoints/`` folder or a ``step_N`` folder,
    see :func:`~crosstrain.checkpoint.resolve.resolve_path`), full and on CPU, named as in the plain model's
    ``state_dict()``. Verifies checksums first unless ``check=False`` or they were just checked."""
    source = resolve_path(path, accept=CHECKPOINT)
    if check and not source.verified:
        verify(source.path).raise_if_bad()
    folder = source.path
    meta = read_meta(folder)
    prefix = meta.get("model_prefix")
    if not prefix:
        raise CheckpointError(f"checkpoint {folder} holds no ModelOptimizerState entry, so it has no model weights")
    md = read_metadata(folder)
    tensors: dict[str, torch.Tensor] = {}
    for fqn, entry in md.state_dict_metadata.items():
        if fqn.startswith(prefix) and isinstance(entry, TensorStorageMetadata):
            tensors[fqn] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    if not tensors:
        raise CheckpointError(f"checkpoint {folder} has no model tensors under {prefix!r}")
    call_dcp(f"loading {folder}", dcp.load, tensors, storage_reader=SafeFileSystemReader(folder),
             planner=SafeLoadPlanner(), no_dist=True)
    return {fqn[len(prefix):]: t for fqn, t in tensors.items()}


def consolidate(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> dict[str, int]:
    """Write the full model tensors of checkpoint ``path`` to the safetensors file ``out`` (atomically)."""
    from safetensors.torch import save_file

    tensors = load_consolidated(path)
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(target) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    return {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
