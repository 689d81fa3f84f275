"""Sparse upcycling (Komatsuzaki et al. 2023): start an MoE model from a trained dense one, every expert a copy
of its block's dense MLP. With ``top_k > 1`` the combine weights sum to 1, so the upcycled model computes
exactly the dense model's function at step 0 (whatever the freshly initialised router picks)."""

from __future__ import annotations

import torch
from torch import nn

from crosstrain.errors import ConfigError
from crosstrain.plugins.moe.layer import MoELayer


def upcycled_state(moe: nn.Module, dense: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The MoE model's state dict filled from the ``dense`` GPT state: shared weights copied, each MoE layer's
    experts ``w1[e] = W1^T``, ``w3[e] = W3^T``, ``w2[e] = W2^T`` of the dense ``feed_forward``; router and
    expert bias keep the MoE model's values."""
    own = moe.state_dict()
    out = dict(own)
    layers = {name.removesuffix(".feed_forward"): m for name, m in moe.named_modules() if isinstance(m, MoELayer)}
    for name, tensor in dense.items():
        block = name.split(".feed_forward.")[0]
        if ".feed_forward." in name and block in layers:
            continue
        if name not in own or own[name].shape != tensor.shape:
            got = tuple(own[name].shape) if name in own else "missing"
            raise ConfigError(f"moe.upcycle_from: dense weight {name} {tuple(tensor.shape)} does not fit the MoE "
                              f"model ({got}); build the MoE run with the dense run's [model] section")
        out[name] = tensor
    for block, layer in layers.items():
        if layer.shared is not None:
            raise ConfigError("moe.upcycle_from copies the dense MLP into routed experts only; "
                              "set moe.shared_experts=0")
        for w in ("w1", "w3", "w2"):
            key = f"{block}.feed_forward.{w}.weight"
            if key not in dense:
                raise ConfigError(f"moe.upcycle_from: the dense state has no {key}; point it at a dense GPT run")
            copy = dense[key].t().unsqueeze(0).expand(layer.num_experts, -1, -1)
            target = f"{block}.feed_forward.experts.{w}"
            if own[target].shape != copy.shape:
                raise ConfigError(f"moe.upcycle_from: {key} has hidden size {dense[key].shape[0 if w != 'w2' else 1]} "
                                  f"but the experts have {tuple(own[target].shape)}; set moe.expert_dim=0")
            out[target] = copy.clone()
    return out


def upcycle_from(moe: nn.Module, source: str) -> None:
    """Load the dense GPT at ``source`` (a run dir, checkpoint or .safetensors file) into ``moe``, in place."""
    from crosstrain.plugins.export.loading import load_model

    dense = load_model(source, what="moe.upcycle_from").model.state_dict()
    moe.load_state_dict(upcycled_state(moe, dense))
