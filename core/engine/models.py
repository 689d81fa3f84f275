"""The run's models: each recipe model parallelised on the mesh, with an optimizer and schedule if trainable.

Trainable models are sharded as configured (FSDP2/DDP/TP/PP) and checkpointed with their optimizer under their
name; frozen models are sharded for inference (no gradients, no optimizer state) and recorded in checkpoints
by source and SHA-256 of their weights, which a resume checks instead of re-loading them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from crosstrain import pluginmanager
from crosstrain.engine.recipe import ModelSpec, Recipe
from crosstrain.engine.state import params_sha256
from crosstrain.errors import CheckpointError, ConfigError, PluginError

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass
class TrainedModel:
    """One named model of the run (this rank's share of it)."""

    name: str
    parallel: Any  # crosstrain.parallel.ParallelModel
    trainable: bool
    source: str
    sha256: str = ""  # frozen models: of their weights when built
    optimizer: torch.optim.Optimizer | None = None
    schedule: Any = None

    @property
    def module(self) -> nn.Module:
        return self.parallel.module

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for p in self.parallel.parameters() if p.requires_grad]

    def checkpoint_key(self, primary: bool) -> str:
        """``app`` for the primary model (the key export and consolidation read), ``app_<name>`` otherwise."""
        return "app" if primary else f"app_{self.name}"


def check_specs(specs: dict[str, ModelSpec], recipe: Recipe, pp: int) -> None:
    """One-line errors for recipes that return unusable model sets."""
    if not specs or not isinstance(specs, dict):
        raise PluginError(f"recipe {recipe.name!r} built no models; build_models must return {{name: ModelSpec}}")
    for name, spec in specs.items():
        if not isinstance(spec, ModelSpec) or not isinstance(spec.module, nn.Module):
            raise PluginError(f"recipe {recipe.name!r} model {name!r} is not a ModelSpec of an nn.Module")
        if not _NAME.match(name):
            raise PluginError(f"recipe {recipe.name!r} model name {name!r} must match [a-z][a-z0-9_]*")
    if not any(spec.trainable for spec in specs.values()):
        raise PluginError(f"recipe {recipe.name!r} has no trainable model")
    if pp > 1 and (not recipe.supports_pipeline or len(specs) != 1):
        raise ConfigError(f"train.recipe={recipe.name!r} does not run under pipeline parallelism (it needs one "
                          "model and a pipeline loss); set parallel.pp=1")


def transform_model(model: nn.Module, name: str, config: Any, trainable: bool = True) -> nn.Module:
    """Apply each plugin's ``crosstrain_transform_model`` in registration order (a failure is fatal)."""
    for _, result in pluginmanager.call_strict("crosstrain_transform_model", "transform the model",
                                               model=model, config=config, name=name, trainable=trainable):
        if result is not None:
            model = result
    return model


def transform_specs(specs: dict[str, ModelSpec], config: Any) -> dict[str, nn.Module]:
    """Each recipe model after the plugins' transforms; a model whose spec is not
    :attr:`~crosstrain.engine.recipe.ModelSpec.transformable` (by default a frozen one) is passed over."""
    return {name: transform_model(spec.module, name, config, spec.trainable) if spec.transformable else spec.module
            for name, spec in specs.items()}


def frozen_sha256(module: nn.Module) -> str:
    """SHA-256 of a (still unsharded) module's weights, as :func:`params_sha256` defines it."""
    return params_sha256({k: v for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)})


class FrozenRecord:
    """Checkpoint entry of the frozen models: ``{name: {source, sha256}}``; loading checks that they match."""

    def __init__(self, models: dict[str, TrainedModel]) -> None:
        self.models = {n: m for n, m in models.items() if not m.trainable}

    def state_dict(self) -> dict[str, Any]:
        return {name: {"source": m.source, "sha256": m.sha256} for name, m in self.models.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, m in self.models.items():
            saved = state.get(name)
            if saved is None:
                raise CheckpointError(f"the checkpoint records no frozen model {name!r}; resume with the recipe "
                                      "and models it was saved with, or start a new run dir")
            if saved["sha256"] != m.sha256:
                raise CheckpointError(
                    f"frozen model {name!r} differs from the one this checkpoint was trained with (source "
                    f"{saved['source']!r}, sha256 {saved['sha256'][:12]}..., now {m.sha256[:12]}...); "
                    "load the same weights or start a new run dir")
