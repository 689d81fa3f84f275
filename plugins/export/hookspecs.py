# mypy: disable-error-code="empty-body"
"""The export plugin's own hook, added to the plugin manager by its ``crosstrain_add_hookspecs``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from crosstrain.hookspecs import hookspec

if TYPE_CHECKING:
    import torch


@hookspec
def crosstrain_export_state_dict(state_dict: dict[str, torch.Tensor], config: Any) -> None:
    """Turn a consolidated model state dict (plain names, full CPU tensors) into plain GPT weights, in place,
    before ``crosstrain export`` or the after-train export builds the model from it (e.g. merge LoRA adapters).

    ``config`` is the run's :class:`crosstrain.config.Config`, or None when the source has no run config.
    Called in registration order, each on the previous one's result; a raising plugin stops the export.
    """
