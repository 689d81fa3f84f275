# mypy: disable-error-code="empty-body"
"""pluggy hook specifications: everything a backend or plugin can add to crosstrain.

Implementations live in modules listed under the ``crosstrain`` entry-point group and are marked with
:data:`crosstrain.hookimpl`. Each hook is a small, documented extension point, in the style of pytest's
hookspecs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

PROJECT = "crosstrain"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

if TYPE_CHECKING:
    import argparse

    import torch

    from crosstrain.backend import Backend
    from crosstrain.kernels import KernelRegistry


@hookspec
def crosstrain_register_backends() -> list[Backend]:
    """Return Backend instances this plugin provides. Two plugins may not claim one backend name."""


@hookspec
def crosstrain_register_kernels(registry: KernelRegistry) -> None:
    """Declare new ops (with a reference implementation) or register implementations of existing ops."""


@hookspec
def crosstrain_config_sections() -> dict[str, type]:
    """Return ``{section_name: pydantic model class}`` to add config sections (e.g. ``moe``, ``fl``)."""


@hookspec
def crosstrain_add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add CLI subcommands. Each parser must set ``func=callable(args) -> int`` via ``set_defaults``."""


@hookspec
def crosstrain_transform_model(model: torch.nn.Module, config: Any) -> torch.nn.Module | None:
    """Replace or modify the model after it is built and before it is parallelised (e.g. MoE layers).

    Return the new model, or None to keep it. Called in plugin registration order.
    """


@hookspec(firstresult=True)
def crosstrain_recipe(name: str) -> Any:
    """Return the training recipe called ``name`` (e.g. ``dpo``, ``ppo``), or None if not this plugin's.

    A recipe owns its step function and may build several models (policy, reference, value, reward).
    """


@hookspec
def crosstrain_transform_gradients(model: torch.nn.Module, step: int, context: Any) -> None:
    """Modify gradients in place after backward and before clipping and the optimizer step.

    Used for secure aggregation and differential privacy (clip + noise).
    """


@hookspec
def crosstrain_checkpoint_state(context: Any) -> dict[str, Any]:
    """Return extra ``{key: Stateful}`` objects to save with every checkpoint and restore on resume."""


@hookspec
def crosstrain_on_step_end(context: Any, step: int, metrics: dict[str, float]) -> None:
    """Called on every rank after each optimizer step with that step's metrics (may add keys to it)."""


@hookspec
def crosstrain_metrics_sinks(config: Any) -> list[Any]:
    """Return metrics sinks (objects with ``write(step, metrics)`` and ``close()``) to receive every metric."""


@hookspec
def crosstrain_after_train(context: Any, run_dir: str) -> None:
    """Called once after training ends (e.g. export the model for inference)."""
