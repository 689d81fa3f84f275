"""A simple, correct local-filesystem Checkpointer: safetensors for tensors, JSON for everything else.

Each rank writes ``rank{R}.safetensors`` and ``rank{R}.json`` under the checkpoint folder, each through a
temporary file, fsync and atomic rename. Loading reads only safetensors and JSON, never pickles.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from crosstrain.checkpoint.interface import Checkpointer, SaveHandle
from crosstrain.checkpoint.tree import copy_into, flatten, unflatten
from crosstrain.errors import CheckpointError


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old file or the complete new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class LocalCheckpointer(Checkpointer):
    """Per-rank safetensors + JSON files in one folder."""

    def __init__(self, rank: int | None = None) -> None:
        self._rank = rank

    @property
    def rank(self) -> int:
        if self._rank is not None:
            return self._rank
        import torch.distributed as dist

        return dist.get_rank() if dist.is_initialized() else 0

    def _files(self, path: Path) -> tuple[Path, Path]:
        return path / f"rank{self.rank}.safetensors", path / f"rank{self.rank}.json"

    def save(self, state: Mapping[str, Any], path: str | os.PathLike[str], *, async_save: bool = False) -> SaveHandle:
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        tensors, skeleton = flatten(state)
        tensor_file, json_file = self._files(folder)
        contiguous = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
        tmp = tensor_file.with_name(tensor_file.name + ".tmp")
        save_file(contiguous, str(tmp))
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, tensor_file)
        atomic_write_bytes(json_file, json.dumps(skeleton, sort_keys=True).encode())
        return SaveHandle()

    def load(self, path: str | os.PathLike[str], state: Mapping[str, Any] | None = None) -> dict[str, Any]:
        folder = Path(path)
        tensor_file, json_file = self._files(folder)
        if not self.exists(folder):
            raise CheckpointError(f"no complete checkpoint for rank {self.rank} at {folder}")
        try:
            skeleton = json.loads(json_file.read_text())
            tensors: dict[str, torch.Tensor] = load_file(str(tensor_file))
        except Exception as exc:
            raise CheckpointError(f"checkpoint {folder} is unreadable: {exc}") from exc
        loaded = unflatten(skeleton, tensors)
        if state is not None:
            return copy_into(state, loaded)
        return loaded

    def exists(self, path: str | os.PathLike[str]) -> bool:
        tensor_file, json_file = self._files(Path(path))
        return tensor_file.is_file() and json_file.is_file()
