"""Turn a GPT's feed-forward blocks into :class:`MoELayer` s (the ``crosstrain_transform_model`` of ``[moe]``)."""

from __future__ import annotations

import math
from collections.abc import Collection

import torch
from torch import nn

from crosstrain.errors import ConfigError
from crosstrain.plugins.moe.config import MoESection
from crosstrain.plugins.moe.experts import expert_hidden
from crosstrain.plugins.moe.layer import MoELayer


def is_moe_block(index: int, every: int, dense: Collection[int] = ()) -> bool:
    """Block ``index`` (0-based) becomes an MoE layer when ``(index + 1) % every == 0`` and it is not in ``dense``:
    every block for ``every=1``, the second, fourth, ... for ``every=2`` (Switch/GShard's every other FFN);
    transformers' Qwen3-MoE decoder layer applies the same test (``decoder_sparse_step``, ``mlp_only_layers``)."""
    return (index + 1) % every == 0 and index not in dense


def to_moe(model: nn.Module, cfg: MoESection, seed: int = 0, hidden: int = 0) -> nn.Module:
    """Replace ``layers.<i>.feed_forward`` by an :class:`MoELayer` for every block ``is_moe_block`` picks, in place.

    Weights come from a generator seeded with ``seed + i`` (GPT's init: std 0.02, output projections
    ``0.02 / sqrt(2 * n_layers)``), so every rank and every copy of the model builds the same experts without
    moving the global RNG stream. ``hidden`` (else ``moe.expert_dim``, else the dense hidden size split over
    the experts a token uses) is one expert's hidden size. Returns ``model``.
    """
    layers = getattr(model, "layers", None)
    gpt = getattr(model, "config", None)
    if not isinstance(layers, nn.ModuleDict) or gpt is None or not hasattr(gpt, "dim"):
        raise ConfigError(f"moe.experts={cfg.experts} needs the built-in GPT (blocks under model.layers with a "
                          f"feed_forward), not {type(model).__name__}; set moe.experts=0 for this model")
    if cfg.every > gpt.n_layers:  # (index + 1) % every == 0 for no block: a dense model under an MoE config
        raise ConfigError(f"moe.every={cfg.every} exceeds model.n_layers={gpt.n_layers}, so no block would be an MoE "
                          f"layer; set moe.every <= {gpt.n_layers}")
    hidden = hidden or expert_hidden(gpt.hidden_dim, cfg.top_k, cfg.shared_experts, cfg.expert_dim)
    std, out_std = 0.02, 0.02 / math.sqrt(2 * gpt.n_layers)
    for key, block in layers.items():
        index = int(key)
        if not is_moe_block(index, cfg.every, cfg.dense_layers) or isinstance(block.feed_forward, MoELayer):
            continue
        layer = MoELayer(gpt.dim, hidden, cfg, layer=f"layers.{key}.feed_forward", layer_id=index)
        layer.init_weights(std, out_std, torch.Generator().manual_seed(seed + index))
        block.feed_forward = layer
    return model


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """The :class:`MoELayer` s inside ``model`` (wrapped by FSDP/DDP or not)."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]
