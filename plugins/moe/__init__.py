"""Mixture-of-Experts: routers, capacity and dropless dispatch, load balancing and expert parallelism.

``[moe] experts = 8`` turns the GPT's feed-forward blocks into :class:`MoELayer` s (see docs/moe.md). The pure
functions (routing, capacity, balancing losses) are importable without a trainer. The names below load on first
use: importing the plugin (entry point discovery) must stay light (no torch.distributed.tensor, no triton).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"GroupedExperts": "experts", "MoELayer": "layer", "moe_layers": "transform", "to_moe": "transform"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"crosstrain.plugins.moe.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
