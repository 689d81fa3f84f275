"""Expert parallelism: the protocol a module implements to have its experts split over the ``ep`` mesh.

A module is expert-parallel-capable when it defines ``apply_expert_parallel(ep_mesh) -> None``: given the
1-D ``ep`` sub-mesh (size ``parallel.ep``), it keeps only this rank's experts and from then on dispatches
tokens to the ranks that hold their experts (e.g. with :func:`crosstrain.parallel.all_to_all_autograd`).
``parallelize`` calls it after tensor parallelism and before activation checkpointing and FSDP. The model
owns the split; core only finds the modules (torchtitan's "the model owns its parallelism").
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import nn

from crosstrain.errors import ConfigError
from crosstrain.parallel.dims import ParallelDims


@runtime_checkable
class ExpertParallel(Protocol):
    """A module whose experts can be split over the ``ep`` ranks (the MoE plugin's experts implement it)."""

    def apply_expert_parallel(self, ep_mesh: Any) -> None:
        """Keep this rank's share of the experts and route tokens over ``ep_mesh``, in place."""
        ...


def expert_modules(model: nn.Module) -> list[ExpertParallel]:
    """The submodules of ``model`` (itself included) that implement :class:`ExpertParallel`."""
    return [m for m in model.modules() if isinstance(m, ExpertParallel)]


def check_expert_model(model: nn.Module, dims: ParallelDims) -> None:
    """Raise :class:`ConfigError` when ``parallel.ep > 1`` but ``model`` has no expert-parallel modules."""
    if dims.ep > 1 and not expert_modules(model):
        raise ConfigError(
            f"parallel.ep={dims.ep} needs a model with experts, but {type(model).__name__} has no module defining "
            "apply_expert_parallel(ep_mesh); set parallel.ep=1 or use a mixture-of-experts model"
        )


def apply_ep(model: nn.Module, ep_mesh: Any) -> None:
    """Call ``apply_expert_parallel(ep_mesh)`` on every expert-parallel submodule of ``model``, in place."""
    # collect first: a module may replace its children while it splits itself
    for module in expert_modules(model):
        module.apply_expert_parallel(ep_mesh)
