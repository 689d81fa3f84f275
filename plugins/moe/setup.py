"""From a run's config to its MoE model: checks against the other sections, the transform, upcycling."""

from __future__ import annotations

from typing import Any

from torch import nn

from crosstrain.plugins.moe.imported import effective_section, imported_fields
from crosstrain.plugins.moe.transform import moe_layers, to_moe


def transform(model: nn.Module, config: Any) -> nn.Module | None:
    """``to_moe(model)`` when ``moe.experts > 0`` (else None: the model stays dense). A model imported from a
    Mixtral / Qwen3-MoE folder already has its MoE layers (the adapter built them to load the weights): they get
    the run's training choices (:func:`~crosstrain.plugins.moe.imported.effective_section`)."""
    cfg = effective_section(config)
    if not cfg.experts:
        return None
    if imported_fields(config) is not None:
        for layer in moe_layers(model):  # to_moe below passes over them
            layer.cfg = cfg.model_copy()
    # layouts MoE cannot run on were refused before any worker started (plugins/moe/rules.py)
    # upcycling copies the dense MLP into each expert: the experts keep the dense hidden size
    hidden = (cfg.expert_dim or getattr(getattr(model, "config", None), "hidden_dim", 0)) if cfg.upcycle_from else 0
    moe = to_moe(model, cfg, seed=config.train.seed, hidden=hidden)
    if cfg.upcycle_from:
        from crosstrain.plugins.moe.upcycle import upcycle_from

        upcycle_from(moe, cfg.upcycle_from)
    return moe
