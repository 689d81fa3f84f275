"""Small pieces of trainer state: canonical parameter hashing and run directories."""

from __future__ import annotations

import datetime
import hashlib
import os
from pathlib import Path
from typing import Any

import torch


def params_sha256(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over ``name`` + fp32 contiguous bytes of every tensor, in sorted-name order."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().to(device="cpu", dtype=torch.float32).contiguous()
        digest.update(name.encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def new_run_dir(root: str | Path) -> Path:
    """``<root>/<UTC timestamp>`` (with a numeric suffix if it already exists); not created."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = Path(root) / stamp
    n = 1
    while path.exists():
        path = Path(root) / f"{stamp}-{n}"
        n += 1
    return path


ENV_RUN_DIR = "CROSSTRAIN_RUN_DIR"


def agree_run_dir(collective: Any, requested: str | os.PathLike[str] | None, root: str) -> Path:
    """The run dir every rank uses: ``requested``, else ``$CROSSTRAIN_RUN_DIR``, else rank 0's new timestamp."""
    chosen = requested or os.environ.get(ENV_RUN_DIR)
    if chosen:
        return Path(chosen)
    proposal = str(new_run_dir(root)) if collective.rank == 0 else ""
    return Path(collective.all_gather_object(proposal)[0])
