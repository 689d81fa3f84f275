"""Stateful adapters for what a trainer checkpoints.

- :class:`ModelOptimizerState`: model + optimizer through ``torch.distributed.checkpoint.state_dict``, so the
  saved keys are the plain model's FQNs whatever the layout (FSDP/TP/compile/activation-checkpoint wrappers),
  and a checkpoint saved under one layout loads under another.
- :class:`RankLocal`: wraps any ``state_dict()/load_state_dict()`` object whose state belongs to one rank
  (RNG, data-sampler position); the manager stores it under a per-rank namespace.
- :class:`RNGState`: Python, CPU and device RNG states of this process.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


class ModelOptimizerState:
    """Model (or model parts, e.g. pipeline stages) and optimizer as one resharding-capable Stateful.

    ``state_dict()`` returns ``{"model": {fqn: tensor}, "optim": {...}}`` with DTensors for sharded
    parameters; ``load_state_dict`` accepts the same structure in any layout that DCP filled in.
    """

    def __init__(self, module: nn.Module | Sequence[nn.Module], optimizer: torch.optim.Optimizer | None = None,
                 *, strict: bool = True) -> None:
        self.modules = [module] if isinstance(module, nn.Module) else list(module)
        self.optimizer = optimizer
        self.strict = strict
        if optimizer is not None and len(self.modules) != 1:
            raise ValueError("ModelOptimizerState with an optimizer takes exactly one module")

    def _options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(strict=self.strict)

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is not None:
            model_sd, optim_sd = get_state_dict(self.modules[0], self.optimizer, options=self._options())
            return {"model": model_sd, "optim": optim_sd}
        model_sd = {}
        for module in self.modules:
            model_sd.update(get_model_state_dict(module, options=self._options()))
        return {"model": model_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if self.optimizer is not None:
            if "optim" not in state_dict:
                raise KeyError("checkpoint has no optimizer state")
            set_state_dict(self.modules[0], self.optimizer, model_state_dict=state_dict["model"],
                           optim_state_dict=state_dict["optim"], options=self._options())
            return
        for module in self.modules:
            names = set(module.state_dict().keys()) if len(self.modules) > 1 else None
            part = state_dict["model"] if names is None else {
                k: v for k, v in state_dict["model"].items() if k in names}
            set_model_state_dict(module, part, options=self._options())


def has_persistent_buffers(module: nn.Module | Sequence[nn.Module]) -> bool:
    """Whether the state dict of ``module`` (or of any of several modules) holds more than parameters."""
    for part in [module] if isinstance(module, nn.Module) else module:
        params = {name for name, _ in part.named_parameters()}
        if any(key not in params for key in part.state_dict(keep_vars=True)):
            return True
    return False


class RankLocal:
    """Marks ``obj`` as per-rank state. With a different world size on load it is skipped with a warning."""

    def __init__(self, obj: Any) -> None:
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"RankLocal needs an object with state_dict/load_state_dict, got {type(obj).__name__}")
        self.obj = obj
        self.optional_entries: tuple[str, ...] = tuple(getattr(obj, "optional_entries", ()))

    def state_dict(self) -> dict[str, Any]:
        return self.obj.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any:
        return self.obj.load_state_dict(state_dict)


class RNGState:
    """This process's RNG states: Python ``random``, torch CPU and (when not CPU) the accelerator's."""

    #: entries a checkpoint may lack: one written on the host has no accelerator RNG, and resuming it on an
    #: accelerator keeps that device's generator as seeded (the checkpoint loader skips these when absent)
    optional_entries = ("device",)

    def __init__(self, device: Any = None) -> None:
        self.device = device  # a crosstrain.device.Device or None

    def _accel(self) -> Any:
        return self.device if self.device is not None and getattr(self.device, "type", "cpu") != "cpu" else None

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        out: dict[str, Any] = {"python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64),
                                          "gauss": gauss},
                               "cpu": torch.get_rng_state()}
        accel = self._accel()
        if accel is not None:
            out["device"] = accel.get_rng_state().cpu()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        py = state_dict["python"]
        random.setstate((int(py["version"]), tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
        torch.set_rng_state(state_dict["cpu"].to(torch.uint8))
        accel = self._accel()
        if accel is not None and "device" in state_dict:
            accel.set_rng_state(state_dict["device"].to(torch.uint8))
