"""Build the optimizer named in the config (AdamW or SGD), with weight decay only on matrices."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from crosstrain.errors import ConfigError


def param_groups(params: Iterable[torch.nn.Parameter], weight_decay: float,
                 lr_scales: dict[int, float] | None = None) -> list[dict[str, Any]]:
    """Two groups: tensors with >= 2 dims get ``weight_decay``, vectors (norm weights, biases) get none. With
    ``lr_scales`` (``{id(param): multiplier}``), each is split further by multiplier, kept as ``lr_scale``."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for p in params:
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    if not lr_scales:
        groups = [{"params": decay, "weight_decay": weight_decay}]
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        return groups
    out: list[dict[str, Any]] = []
    for members, wd in ((decay, weight_decay), (no_decay, 0.0)):
        scales = sorted({lr_scales.get(id(p), 1.0) for p in members}, reverse=True)
        for scale in scales:
            out.append({"params": [p for p in members if lr_scales.get(id(p), 1.0) == scale], "weight_decay": wd,
                        "lr_scale": scale})
    return out


def split_by_tensor_kind(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each group split into its DTensor and its plain-tensor parameters (same settings): torch's fused and foreach
    steps take a group's tensors in one call, which refuses a mix ("got mixed torch.Tensor and DTensor"), as under
    tp where the tensor-parallel plan leaves some parameters (MoE's) plain. Elementwise updates: the same step."""
    from torch.distributed.tensor import DTensor

    out: list[dict[str, Any]] = []
    for group in groups:
        for is_dtensor in (True, False):
            members = [p for p in group["params"] if isinstance(p, DTensor) == is_dtensor]
            if members:
                out.append({**group, "params": members})
    return out


def torch_hyper(optim_cfg: Any) -> dict[str, Any]:
    """The ``torch.optim`` keyword arguments of an ``[optim]`` section (weight decay is per group)."""
    if optim_cfg.name == "adamw":
        return {"lr": optim_cfg.lr, "betas": tuple(optim_cfg.betas), "eps": optim_cfg.eps}
    if optim_cfg.name == "sgd":
        return {"lr": optim_cfg.lr, "momentum": optim_cfg.momentum}
    raise ConfigError(f"unknown optim.name {optim_cfg.name!r}; allowed: adamw, sgd")


def build_optimizer(params: Iterable[torch.nn.Parameter], optim_cfg: Any, device: torch.device | None = None,
                    backend: Any = None, lr_scales: dict[int, float] | None = None) -> torch.optim.Optimizer:
    """An optimizer for ``params`` from an ``[optim]`` section; ``offload = true`` uses the host optimizer.

    ``optim.impl``: ``torch`` builds ``torch.optim``; ``native`` the active ``backend``'s fast step
    (:meth:`crosstrain.backend.Backend.fast_optimizer`, an error where it has none); ``auto`` the fast step where
    the backend has one, else ``torch.optim``. The choice is on the optimizer as ``crosstrain_impl``.
    ``lr_scales`` (``{id(param): multiplier}``) gives groups their own learning rate, ``optim.lr x multiplier``,
    which the LR schedule then scales like every group's.
    """
    params = list(params)
    if not params:
        raise ConfigError("the model has no trainable parameters")
    impl = getattr(optim_cfg, "impl", "torch")
    if optim_cfg.offload and lr_scales:
        raise ConfigError("optim.offload=true steps one learning rate for all parameters; set optim.offload=false "
                          "for per-layer learning rates (classify.layer_decay)")
    if optim_cfg.offload:
        try:
            from crosstrain.optim.offload import OffloadOptimizer
        except ImportError:
            raise ConfigError("optim.offload=true needs crosstrain.optim.offload, which this build lacks; "
                              "set optim.offload=false") from None
        # the host update runs the kernel registry's adamw_step/sgd_step; impl=torch pins it to the reference
        opt: torch.optim.Optimizer = OffloadOptimizer(params, optim_cfg, device, reference=impl == "torch")
        opt.crosstrain_impl = "offload-reference" if impl == "torch" else "offload"  # type: ignore[attr-defined]
        return opt
    groups = split_by_tensor_kind(param_groups(params, optim_cfg.weight_decay, lr_scales))
    hyper = torch_hyper(optim_cfg)
    for group in groups:
        if "lr_scale" in group:
            group["lr"] = hyper["lr"] * group.pop("lr_scale")
    if impl != "torch" and backend is not None:
        fast = backend.fast_optimizer(optim_cfg.name, groups, hyper)
        if fast is not None:
            opt, label = fast
            opt.crosstrain_impl = label  # type: ignore[attr-defined]
            return opt
    if impl == "native":
        name = getattr(backend, "name", "none")
        raise ConfigError(f"optim.impl=native: backend {name!r} has no fast {optim_cfg.name} step here; "
                          "set optim.impl=auto or torch")
    cls: type[torch.optim.Optimizer] = torch.optim.AdamW if optim_cfg.name == "adamw" else torch.optim.SGD
    opt = cls(groups, **hyper)  # type: ignore[operator]
    opt.crosstrain_impl = "torch"  # type: ignore[attr-defined]
    return opt
