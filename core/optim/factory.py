"""Build the optimizer named in the config (AdamW or SGD), with weight decay only on matrices."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from crosstrain.errors import ConfigError


def param_groups(params: Iterable[torch.nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: tensors with >= 2 dims get ``weight_decay``, vectors (norm weights, biases) get none."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for p in params:
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(params: Iterable[torch.nn.Parameter], optim_cfg: Any, device: torch.device | None = None
                    ) -> torch.optim.Optimizer:
    """An optimizer for ``params`` from an ``[optim]`` section; ``offload = true`` uses the host optimizer."""
    params = list(params)
    if not params:
        raise ConfigError("the model has no trainable parameters")
    if optim_cfg.offload:
        try:
            from crosstrain.optim.offload import OffloadOptimizer
        except ImportError:
            raise ConfigError("optim.offload=true needs crosstrain.optim.offload, which this build lacks; "
                              "set optim.offload=false") from None
        return OffloadOptimizer(params, optim_cfg, device)
    groups = param_groups(params, optim_cfg.weight_decay)
    if optim_cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), eps=optim_cfg.eps)
    if optim_cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=optim_cfg.lr, momentum=optim_cfg.momentum)
    raise ConfigError(f"unknown optim.name {optim_cfg.name!r}; allowed: adamw, sgd")
