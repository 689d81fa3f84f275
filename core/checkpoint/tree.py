"""Flatten a nested state tree into ``{dotted.key: tensor}`` plus a JSON skeleton, and back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from crosstrain.errors import CheckpointError

TENSOR_TAG = "__tensor__"
_SCALARS = (int, float, str, bool, type(None))


def flatten(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], Any]:
    """Split ``state`` into its tensors (by path) and a JSON-able skeleton referencing them."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            tensors[path] = node.detach()
            return {TENSOR_TAG: path}
        if isinstance(node, Mapping):
            out = {}
            for key, value in node.items():
                if not isinstance(key, str):
                    key = str(key)
                out[key] = walk(value, f"{path}.{key}" if path else key)
            return out
        if isinstance(node, (list, tuple)):
            return [walk(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(node)]
        if isinstance(node, _SCALARS):
            return node
        raise CheckpointError(
            f"cannot checkpoint {path or '<root>'} of type {type(node).__name__}; "
            "use tensors, dicts, lists and JSON scalars"
        )

    return tensors, walk(state, "")


def unflatten(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild the tree from :func:`flatten`'s skeleton and the loaded tensors."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {TENSOR_TAG}:
            key = skeleton[TENSOR_TAG]
            if key not in tensors:
                raise CheckpointError(f"checkpoint is missing tensor {key!r}")
            return tensors[key]
        return {k: unflatten(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    return skeleton


def copy_into(target: Any, loaded: Any, path: str = "") -> Any:
    """Copy loaded tensors into ``target``'s tensors in place (keeping their device and dtype)."""
    if isinstance(target, torch.Tensor):
        if not isinstance(loaded, torch.Tensor):
            raise CheckpointError(f"checkpoint has no tensor at {path or '<root>'}")
        if tuple(target.shape) != tuple(loaded.shape):
            raise CheckpointError(
                f"shape mismatch at {path}: checkpoint {tuple(loaded.shape)} vs model {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(loaded)
        return target
    if isinstance(target, Mapping):
        if not isinstance(loaded, Mapping):
            raise CheckpointError(f"checkpoint has no mapping at {path or '<root>'}")
        return {k: copy_into(v, loaded.get(k), f"{path}.{k}" if path else k) for k, v in target.items()}
    return loaded
