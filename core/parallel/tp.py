"""Tensor parallelism: apply every DTensor ``parallelize_module`` plan the model's modules declare.

The plans come from the model (``tp_plan()`` methods or :func:`crosstrain.parallel.register_parallel_plan`,
see ``plan.py``); this file knows no model's attribute names. The built-in GPT's Megatron-style plan lives
on its ``Attention``, ``FeedForward`` and ``GPT`` classes (core/models/gpt.py).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from crosstrain.parallel.plan import tp_plans


def apply_tp(model: nn.Module, tp_mesh: Any) -> int:
    """Shard ``model`` (or one pipeline stage of it) over ``tp_mesh`` in place; returns how many plans ran."""
    # Collect every plan before applying any, so each plan method sees the plain model, not parameters an
    # earlier plan already turned into DTensors.
    plans = tp_plans(model)
    for module, plan in plans:
        if plan:
            parallelize_module(module, tp_mesh, plan)
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    return len(plans)
