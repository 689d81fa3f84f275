"""The MoE plugin's contribution to the ``gpt`` model family (:mod:`crosstrain.models.family`): the parameters its
experts add (the memory estimate behind ``parallel.layout = "auto"``) and the ones a token does not use (MFU counts
a token's ``top_k`` routed experts, not all of them), and the Hugging Face adapters of the MoE checkpoints its layers
import and export (Mixtral, Qwen3-MoE: :mod:`.hf_adapter`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from crosstrain.models.family import FamilyExtension


def extra_params(cfg: Any, config: Any) -> int:
    """Parameters ``to_moe`` adds to a GPT of config ``cfg``: per MoE block, the router ``[E, dim]``, ``E`` routed
    SwiGLU experts and the shared experts, less the dense MLP they replace (0 when ``moe.experts = 0``)."""
    from crosstrain.plugins.moe.experts import expert_hidden
    from crosstrain.plugins.moe.imported import effective_section
    from crosstrain.plugins.moe.transform import is_moe_block

    sec = effective_section(config) if "moe" in config.plugins else None
    if sec is None or not sec.experts:
        return 0
    if sec.upcycle_from:  # upcycled experts keep the dense hidden size (plugins/moe/setup.py)
        hidden = sec.expert_dim or cfg.hidden_dim
    else:
        hidden = expert_hidden(cfg.hidden_dim, sec.top_k, sec.shared_experts, sec.expert_dim)
    dim = cfg.dim
    per_layer = sec.experts * dim + 3 * dim * hidden * (sec.experts + sec.shared_experts) - 3 * dim * cfg.hidden_dim
    return per_layer * sum(is_moe_block(i, sec.every, sec.dense_layers) for i in range(cfg.n_layers))


def inactive_params(model: nn.Module) -> int:
    """Routed-expert parameters a token skips: ``(E - top_k) / E`` of each MoE layer's experts (their global size:
    under expert or tensor parallelism the weights are DTensors, whose ``numel`` is the full tensor's)."""
    from crosstrain.plugins.moe.transform import moe_layers

    skipped = 0
    for layer in moe_layers(model):
        held = sum(p.numel() for p in layer.experts.parameters())
        skipped += held * (layer.num_experts - layer.cfg.top_k) // layer.num_experts
    return skipped


def _extension() -> FamilyExtension:
    from crosstrain.plugins.moe.hf_adapter import ADAPTERS

    return FamilyExtension(name="moe", family="gpt", extra_params=extra_params, inactive_params=inactive_params,
                           parallel_dims=("ep",), hf_adapters=ADAPTERS)


MOE_EXTENSION = _extension()
