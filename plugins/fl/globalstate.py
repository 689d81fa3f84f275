"""The server's global model between rounds: a flat float32 vector, checkpointed once per completed round.

Each round's weights go to ``<run dir>/global/round_<r>.safetensors`` (tensors under the model's own names, so
``model.init_from`` and ``crosstrain export`` read the file), then ``latest.json`` names it with its SHA-256;
both are written atomically (crosstrain's ``atomic_write``), so a server killed at any point resumes at the
last completed round.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from crosstrain.checkpoint.atomic import atomic_write
from crosstrain.errors import CheckpointError

LATEST = "latest.json"


class Layout:
    """Names and shapes of a model's parameters, in order: how the flat vector maps onto the model."""

    def __init__(self, model: nn.Module) -> None:
        self.names = [n for n, _ in model.named_parameters()]
        self.shapes = [tuple(p.shape) for _, p in model.named_parameters()]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.dim = sum(self.sizes)

    def flatten(self, model: nn.Module) -> np.ndarray:
        with torch.no_grad():
            return torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()]).numpy()

    def tensors(self, vector: np.ndarray) -> dict[str, torch.Tensor]:
        if vector.shape != (self.dim,):
            raise CheckpointError(f"global vector has shape {vector.shape}, the model has {self.dim} parameters")
        out, offset = {}, 0
        flat = torch.from_numpy(np.ascontiguousarray(vector, dtype=np.float32))
        for name, shape, size in zip(self.names, self.shapes, self.sizes, strict=True):
            out[name] = flat[offset:offset + size].reshape(shape).clone()
            offset += size
        return out

    @torch.no_grad()
    def load_into(self, model: nn.Module, vector: np.ndarray) -> None:
        tensors = self.tensors(vector)
        for name, param in model.named_parameters():
            param.copy_(tensors[name].to(param.dtype))


def save_round(folder: Path, layout: Layout, vector: np.ndarray, completed: int, extra: dict[str, Any],
               keep_last: int) -> Path:
    """Write the global model after ``completed`` rounds and point ``latest.json`` at it; prune old rounds."""
    from safetensors.torch import save

    folder.mkdir(parents=True, exist_ok=True)
    data = save(layout.tensors(vector), metadata={"rounds_completed": str(completed)})
    path = folder / f"round_{completed:06d}.safetensors"
    atomic_write(path, data)
    record = {"rounds_completed": completed, "file": path.name, "sha256": hashlib.sha256(data).hexdigest(), **extra}
    atomic_write(folder / LATEST, json.dumps(record, indent=1).encode())
    for old in sorted(folder.glob("round_*.safetensors"))[:-keep_last]:
        old.unlink()
    return path


def load_latest(folder: Path, layout: Layout) -> tuple[np.ndarray, dict[str, Any]] | None:
    """``(vector, record)`` of the last completed round, or None for a fresh run; CheckpointError if damaged."""
    latest = folder / LATEST
    if not latest.is_file():
        return None
    from safetensors.torch import load

    record = json.loads(latest.read_text())
    path = folder / str(record["file"])
    data = path.read_bytes() if path.is_file() else b""
    if hashlib.sha256(data).hexdigest() != record.get("sha256"):
        raise CheckpointError(f"{path} is missing or does not match the SHA-256 in {latest}; restore it or start a "
                              "new run dir")
    tensors = load(data)
    if sorted(tensors) != sorted(layout.names):
        raise CheckpointError(f"{path} does not hold this model's parameters; use the config it was trained with")
    vector = torch.cat([tensors[n].reshape(-1).float() for n in layout.names]).numpy()
    return vector, record
