"""An exponential moving average of a model's weights: timm's ``ModelEmaV3`` (its decay schedule and update),
fed the full tensors of a sharded model, and checkpointed with the run."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from crosstrain.errors import ConfigError


class _FullTensors:
    """What ``ModelEmaV3.update`` reads of a model (``state_dict()``), with sharded tensors gathered whole."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, torch.Tensor]:
        from torch.distributed.tensor import DTensor

        return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in self.module.state_dict().items()}


class Ema:
    """A replica of the model (on every rank) that moves toward the live weights after each optimizer step."""

    def __init__(self, model: nn.Module, decay: float, warmup: bool, device: torch.device) -> None:
        from crosstrain.plugins.vision.tv import timm

        timm()
        from timm.utils import ModelEmaV3

        self.ema = ModelEmaV3(model, decay=decay, use_warmup=warmup, device=device)
        self.size = len(self.ema.module.state_dict())

    @property
    def module(self) -> nn.Module:
        return self.ema.module

    def update(self, model: nn.Module, step: int) -> None:
        view = _FullTensors(model)
        if len(model.state_dict()) != self.size:
            raise ConfigError("classify.ema_decay: a plugin changed the model after it was built (its tensors no "
                              "longer match the EMA's); set classify.ema_decay=0")
        self.ema.update(view, step)

    def state_dict(self) -> dict[str, Any]:
        return {"module": self.ema.module.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema.module.load_state_dict(state["module"])
