"""Model tensors of a (possibly sharded) DCP checkpoint, read a few at a time instead of all at once.

``crosstrain.checkpoint.consolidate.load_consolidated`` materialises the whole model; an export that writes
shards only needs one shard's tensors at a time, so this reads the checkpoint's metadata once and then loads any
subset of the model tensors, full and on CPU, through the same never-unpickling reader.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from crosstrain.errors import CheckpointError

if TYPE_CHECKING:
    from crosstrain.checkpoint.resolve import Resolved


def clean_name(name: str) -> str:
    """Plain GPT names: drop the wrappers activation checkpointing and torch.compile add."""
    return name.replace("._checkpoint_wrapped_module", "").replace("_orig_mod.", "")


class CheckpointTensors:
    """The model tensors of the checkpoint at ``path`` (see :func:`~crosstrain.checkpoint.resolve.resolve_path`),
    by plain GPT name, loadable in groups."""

    def __init__(self, path: str | os.PathLike[str] | Resolved) -> None:
        from crosstrain.checkpoint.dcp import read_meta
        from crosstrain.checkpoint.resolve import CHECKPOINT, resolve_path
        from crosstrain.checkpoint.safe_io import read_metadata
        from crosstrain.checkpoint.verify import verify

        source = resolve_path(path, accept=CHECKPOINT)
        if not source.verified:
            verify(source.path).raise_if_bad()
        self.folder = source.path
        prefix = read_meta(self.folder).get("model_prefix")
        if not prefix:
            raise CheckpointError(f"checkpoint {self.folder} holds no ModelOptimizerState entry, so it has no model "
                                  "weights")
        self._entries: dict[str, tuple[str, TensorStorageMetadata]] = {}
        for fqn, entry in read_metadata(self.folder).state_dict_metadata.items():
            if fqn.startswith(prefix) and isinstance(entry, TensorStorageMetadata):
                self._entries[clean_name(fqn[len(prefix):])] = (fqn, entry)
        if not self._entries:
            raise CheckpointError(f"checkpoint {self.folder} has no model tensors under {prefix!r}")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(entry.size) for name, (_, entry) in self._entries.items()}

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The named tensors (full, CPU, saved dtype); only their bytes are read."""
        from crosstrain.checkpoint.safe_io import SafeFileSystemReader, SafeLoadPlanner, call_dcp

        buffers = {}
        for name in names:
            fqn, entry = self._entries[name]
            buffers[fqn] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        with warnings.catch_warnings():  # a single-process load is the point here, not a misconfiguration
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            call_dcp(f"loading {self.folder}", dcp.load, buffers, storage_reader=SafeFileSystemReader(self.folder),
                     planner=SafeLoadPlanner(), no_dist=True)
        return {name: buffers[self._entries[name][0]] for name in names}
