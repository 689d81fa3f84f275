# mypy: disable-error-code="empty-body"
"""pluggy hook specifications: everything a backend or plugin can add to crosstrain.

Implementations live in modules listed under the ``crosstrain`` entry-point group and are marked with
:data:`crosstrain.hookimpl`. Each hook is a small, documented extension point, in the style of pytest's
hookspecs. An implementation may take any subset of a hook's arguments. Every hook here has an implementer in
a shipped plugin (``tests/test_pluginmanager.py`` checks it); ``crosstrain plugins`` lists who implements what.

A plugin that brings its own extension points (the export plugin's ``crosstrain_export_state_dict``, the
observability plugin's ``crosstrain_report_panels``) adds their specs from ``crosstrain_add_hookspecs``.

Order: every hook is called in plugin registration order (entry points load sorted by name; in-process
``crosstrain.pluginmanager.register`` appends), first registered first. ``@hookimpl(tryfirst=True)`` moves
an implementation to the front and ``trylast=True`` to the back. Hook wrappers (``@hookimpl(wrapper=True)`` or
``hookwrapper=True``) run around all the implementations of a call, as in pluggy: the first (``tryfirst``, then
registration order) outermost; each gets the list of results at its ``yield``.

Run-time hooks receive ``context``, a :class:`crosstrain.engine.context.RunContext` (config, run dir, rank and
world, mesh and dims, device, models and optimizers by name, step, ``emit_event``, ``request_stop``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

PROJECT = "crosstrain"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable
    from contextlib import AbstractContextManager

    import torch

    from crosstrain.backend import Backend
    from crosstrain.engine.context import RunContext
    from crosstrain.engine.evaluate_tasks import TaskRequest
    from crosstrain.engine.recipe import Recipe


@hookspec(historic=True)
def crosstrain_add_hookspecs(pluginmanager: pluggy.PluginManager) -> None:
    """Add this plugin's own hook specifications with ``pluginmanager.add_hookspecs(module)``, so other plugins can
    implement them. Called once for each plugin as it registers (pytest's ``pytest_addhooks``)."""


@hookspec
def crosstrain_register_backends() -> list[Backend]:
    """Return Backend instances this plugin provides (fast kernels come with a backend:
    ``Backend.register_kernels``). Two plugins may not claim one backend name."""


@hookspec
def crosstrain_config_sections() -> dict[str, type]:
    """Return ``{section_name: pydantic model class}`` to add config sections (e.g. ``moe``, ``fl``). A section is
    validated with ``context={"config": <the validated core sections>}``, so its validators may check it against
    them (``observability.profile_steps`` against ``train.steps``)."""


@hookspec
def crosstrain_add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add CLI subcommands. Each parser must set ``func=callable(args) -> int`` via ``set_defaults``."""


@hookspec
def crosstrain_transform_model(model: torch.nn.Module, config: Any, name: str,
                               trainable: bool) -> torch.nn.Module | None:
    """Replace or modify a model after it is built and before it is parallelised (e.g. MoE layers).

    Called for every model of the recipe whose ``ModelSpec`` allows it: the trainable ones, and frozen ones
    only with ``ModelSpec(transform=True)`` (a reference copy of the policy); a frozen model loaded from a
    source is never passed, so it keeps the weights it was loaded with. ``name`` is the recipe's (``model``
    in ``lm``; ``policy``, ``reference`` ... in others), ``trainable`` whether it gets gradients. Return the
    new model, or None to keep it. A module the plugin brings supplies its own parallel plan (``tp_plan()``,
    see docs/parallelism.md). A raising plugin stops the run.
    """


@hookspec
def crosstrain_model_families() -> list[Any]:
    """Return :class:`crosstrain.models.family.ModelFamily` bundles (a new family of models: config, presets,
    build, checks, estimates, HF adapters) and :class:`~crosstrain.models.family.FamilyExtension` s (what a
    transform such as MoE changes in a family's parameter and FLOP estimates). A family owns its presets."""


@hookspec(firstresult=True)
def crosstrain_recipe(name: str) -> Recipe | type[Recipe] | None:
    """Return the :class:`crosstrain.engine.recipe.Recipe` (or its class) called ``name``, or None.

    The first plugin (in call order) to return one wins and the rest are not asked; built-in recipes (``lm``)
    take precedence.
    """


@hookspec
def crosstrain_recipe_names() -> list[str]:
    """Return the recipe names this plugin provides (listed in the error for an unknown ``train.recipe``)."""


@hookspec
def crosstrain_after_optimizer_step(context: RunContext, step: int) -> None:
    """Called on every rank after each optimizer step (also a skipped non-finite one) and the LR schedule.

    For plugins that change parameters once a step or a round ends (federated averaging). A raising plugin
    stops the run.
    """


@hookspec
def crosstrain_on_step_end(context: RunContext, step: int, metrics: dict[str, float]) -> None:
    """Called on every rank after each step with that step's metrics (may add keys to it); a raising plugin
    is reported and skipped."""


@hookspec
def crosstrain_eval_variants(config: Any) -> dict[str, Callable[[torch.nn.Module], AbstractContextManager[Any]]]:
    """Other ways to evaluate the models, each run after the plain evaluation and reported beside it as
    ``eval/<name>/<metric>``: ``{name: enter}``, where ``enter(module)`` returns a context manager the evaluation
    runs inside, entered for every model of the run (QAT's ``fp``: fake quantisation off). Return ``{}`` when the
    config asks for none; a raising plugin stops the run."""


@hookspec(firstresult=True)
def crosstrain_score_tasks(request: TaskRequest) -> dict[str, Any] | None:
    """Score benchmark tasks (lm-evaluation-harness names or task YAML files) on ``request.model``: return
    ``{"scores": {"<task>/<metric>": value}, "samples": {task: [per-item records]}}``. Called by ``crosstrain eval
    --tasks`` and at each evaluation of a run with ``eval.tasks`` (reported as ``eval/<task>/<metric>``); the
    evaluate plugin implements it. A raising plugin stops the run."""


@hookspec
def crosstrain_metrics_sinks(config: Any) -> list[Any]:
    """Return metrics sinks for rank 0: objects with ``write(step, metrics)`` and ``close()``, optionally
    ``open(info)`` and ``event(step, name, fields)`` (see :mod:`crosstrain.engine.metrics`)."""


@hookspec
def crosstrain_after_train(context: RunContext, run_dir: str) -> None:
    """Called once after training ends (e.g. export the model for inference)."""


@hookspec
def crosstrain_refusal_rules() -> list[Any]:
    """Return :class:`crosstrain.config.rules.Rule` objects: the combinations of config and layout this plugin
    refuses (checked in the launcher before any worker starts, and listed in docs/parallelism.md)."""
