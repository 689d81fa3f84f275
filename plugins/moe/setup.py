"""From a run's config to its MoE model: checks against the other sections, the transform, upcycling."""

from __future__ import annotations

from typing import Any

from torch import nn

from crosstrain.plugins.moe.config import MoESection
from crosstrain.plugins.moe.transform import to_moe


def transform(model: nn.Module, config: Any) -> nn.Module | None:
    """``to_moe(model)`` when ``moe.experts > 0`` (else None: the model stays dense)."""
    cfg = config.section("moe")
    assert isinstance(cfg, MoESection)
    if not cfg.experts:
        return None
    # layouts MoE cannot run on were refused before any worker started (plugins/moe/rules.py)
    # upcycling copies the dense MLP into each expert: the experts keep the dense hidden size
    hidden = (cfg.expert_dim or getattr(getattr(model, "config", None), "hidden_dim", 0)) if cfg.upcycle_from else 0
    moe = to_moe(model, cfg, seed=config.train.seed, hidden=hidden)
    if cfg.upcycle_from:
        from crosstrain.plugins.moe.upcycle import upcycle_from

        upcycle_from(moe, cfg.upcycle_from)
    return moe
