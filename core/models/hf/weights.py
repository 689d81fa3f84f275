"""Hugging Face weight files: read ``model.safetensors`` or a sharded ``model.safetensors.index.json`` tensor by
tensor, and write shards (with the index above a size limit) one shard at a time.

The layout is transformers' ``save_pretrained``: shards ``model-00001-of-0000N.safetensors`` filled in order
until the next tensor would pass the limit, an index ``{"metadata": {"total_size"}, "weight_map"}``, and
``{"format": "pt"}`` in each file's metadata (transformers refuses safetensors files without it).
Only safetensors and JSON are read, so loading never executes code.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from crosstrain.checkpoint.atomic import atomic_path, atomic_write
from crosstrain.errors import ConfigError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def weight_files(folder: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of an HF model folder (from the index when there is one)."""
    root = Path(folder)
    if (root / INDEX).is_file():
        try:
            weight_map = json.loads((root / INDEX).read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"{root / INDEX} is not a safetensors index ({exc})") from None
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"{root / INDEX} names {missing[0].name}, which is missing; download the whole model")
        return files
    if (root / SINGLE).is_file():
        return [root / SINGLE]
    if any(root.glob("*.bin")) or any(root.glob("*.pth")):
        raise ConfigError(f"{root} has only pickle weights (.bin/.pth), which crosstrain never loads; convert them "
                          "to safetensors (save_pretrained(..., safe_serialization=True))")
    raise ConfigError(f"{root} has no {SINGLE} or {INDEX}; it is not a Hugging Face model folder")


@contextlib.contextmanager
def open_safetensors(path: str | os.PathLike[str]) -> Iterator[Any]:
    """``safe_open(path)``, a truncated or garbage file (``SafetensorError``) raised as one ConfigError naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            yield fh
    except SafetensorError as exc:
        raise ConfigError(f"{path} is not a readable safetensors file ({exc}): it is truncated or not safetensors; "
                          "copy, download or export it again") from None


def load_safetensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file (see :func:`open_safetensors` for a bad file)."""
    with open_safetensors(path) as fh:
        return {name: fh.get_tensor(name) for name in fh.keys()}


def iter_tensors(folder: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` for every tensor of the folder, one at a time (memory-mapped reads)."""
    for path in weight_files(folder):
        with open_safetensors(path) as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Group ``(name, nbytes)`` in order into shards of at most ``max_bytes`` (a bigger tensor gets its own)."""
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, nbytes in sizes:
        if current and used + nbytes > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    if current:
        shards.append(current)
    return shards


def write_weights(
    out: str | os.PathLike[str], shards: list[list[str]], load: Callable[[list[str]], dict[str, torch.Tensor]],
) -> list[Path]:
    """Write each shard from ``load(names)`` (called once per shard, so only one shard is in memory at a time)
    as ``model.safetensors`` (one shard) or numbered shards + index. Returns the files written."""
    from safetensors.torch import save_file

    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    n = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    written = []
    for i, names in enumerate(shards, start=1):
        file = SINGLE if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in load(names).items()}
        with atomic_path(root / file) as tmp:
            save_file(tensors, str(tmp), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({k: file for k in tensors})
        written.append(root / file)
        del tensors
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        atomic_write(root / INDEX, json.dumps(index, indent=2) + "\n")
        written.append(root / INDEX)
    return written


_UNITS = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "b": 1}


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5e9 bytes (transformers' ``max_shard_size`` convention: KB/MB/GB decimal, KiB/MiB/GiB binary)."""
    if isinstance(text, int):
        return text
    s = str(text).strip().lower().replace(" ", "")
    for unit in sorted(_UNITS, key=len, reverse=True):
        if s.endswith(unit) and s[: -len(unit)]:
            try:
                return int(float(s[: -len(unit)]) * _UNITS[unit])
            except ValueError:
                break
    if s.isdigit():
        return int(s)
    raise ConfigError(f"size {text!r} is not understood; write it like 5GB, 500MB or 2GiB")
