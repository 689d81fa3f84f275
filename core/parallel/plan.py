"""How a model declares its parallel plans: methods on its modules, or functions registered for their classes.

Three optional methods, all found on the module itself or registered for its class with
:func:`register_parallel_plan` (for classes you cannot edit; a registration overrides a method defined on the
same class, and the most derived class wins):

- ``tp_plan(self) -> dict[str, ParallelStyle]``: a DTensor ``parallelize_module`` plan, keys relative to this
  module. Any submodule may have one; tensor parallelism applies every plan in the tree, so a block's
  attention and its MLP each bring their own, and a plugin that swaps the MLP swaps its plan with it. Plans
  must not cover the same parameter twice. Afterwards the model's ``tie_weights()`` (as in Hugging Face
  models) runs, if it has one, to re-tie weights that two plans turned into separate DTensors.
- ``pipeline_split(self, pp, stage) -> None`` (the model only): turn the model, in place, into pipeline
  stage ``stage`` of ``pp``; parameter names must stay those of the full model.
- ``ac_units(self) -> dict[str, int]`` (the model only): the dotted path of each repeated block this module
  holds -> its index in the full model (so pipeline stages agree on ``every:N``). They are the units of
  activation checkpointing, per-block compile and FSDP2 sharding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

from torch import nn

from crosstrain.errors import ConfigError

KINDS = ("tp_plan", "pipeline_split", "ac_units")

_REGISTRY: dict[type, dict[str, Callable[..., Any]]] = {}


class ParallelPlanned(Protocol):
    """Documentation of the three methods; a module defines any subset of them."""

    def tp_plan(self) -> dict[str, Any]: ...

    def pipeline_split(self, pp: int, stage: int) -> None: ...

    def ac_units(self) -> dict[str, int]: ...


def register_parallel_plan(module_cls: type[nn.Module], tp_plan: Callable[[Any], dict[str, Any]] | None = None, *,
                           pipeline_split: Callable[[Any, int, int], None] | None = None,
                           ac_units: Callable[[Any], dict[str, int]] | None = None) -> None:
    """Give ``module_cls`` plans without editing it; each function takes the module as its first argument."""
    given = {"tp_plan": tp_plan, "pipeline_split": pipeline_split, "ac_units": ac_units}
    plans = {kind: fn for kind, fn in given.items() if fn is not None}
    if not plans:
        raise ConfigError(f"register_parallel_plan({module_cls.__name__}) got no plan; pass tp_plan, "
                          "pipeline_split or ac_units")
    _REGISTRY.setdefault(module_cls, {}).update(plans)


def find_plan(module: nn.Module, kind: str) -> Callable[..., Any] | None:
    """``kind`` (one of :data:`KINDS`) for ``module``, bound to it, or None when it has none."""
    for cls in type(module).__mro__:
        registered = _REGISTRY.get(cls, {}).get(kind)
        if registered is not None:
            return functools.partial(registered, module)
        if kind in vars(cls):
            method = getattr(module, kind)
            return method if callable(method) else None  # ``tp_plan = None`` opts a subclass out
    return None


def tp_plans(model: nn.Module) -> list[tuple[nn.Module, dict[str, Any]]]:
    """Every ``(submodule, plan)`` in ``model``'s tree that has a tensor-parallel plan, parents first."""
    found = [(sub, find_plan(sub, "tp_plan")) for sub in model.modules()]
    return [(sub, fn()) for sub, fn in found if fn is not None]


#: kind -> (what is missing, the method to define, the registry keyword)
_NEEDS = {
    "tp_plan": ("a tensor-parallel plan", "tp_plan()", "..."),
    "pipeline_split": ("a pipeline split", "pipeline_split(pp, stage)", "pipeline_split=..."),
    "ac_units": ("block units", "ac_units()", "ac_units=..."),
}


def missing_plan(model: nn.Module, kind: str, request: str, fix: str) -> ConfigError:
    """The one-line error for ``request`` (e.g. ``parallel.tp=2``) on a model without a ``kind`` plan."""
    what, define, keyword = _NEEDS[kind]
    name = type(model).__name__
    return ConfigError(f"{request} needs {what}, but model class {name} has none; define {name}.{define} or "
                       f"crosstrain.parallel.register_parallel_plan({name}, {keyword}) or set {fix}")


def check_plans(model: nn.Module, *, tp: int, pp: int, activation_checkpoint: str | None,
                compile: bool | str) -> None:
    """Raise a one-line :class:`ConfigError` when a requested layout has no plan (``activation_checkpoint``
    is the mode, None when off)."""
    if tp > 1 and not any(find_plan(sub, "tp_plan") for sub in model.modules()):
        raise missing_plan(model, "tp_plan", f"parallel.tp={tp}", "parallel.tp=1")
    if pp > 1 and find_plan(model, "pipeline_split") is None:
        raise missing_plan(model, "pipeline_split", f"parallel.pp={pp}", "parallel.pp=1")
    if find_plan(model, "ac_units") is None:
        if activation_checkpoint:
            raise missing_plan(model, "ac_units", f"parallel.activation_checkpoint={activation_checkpoint!r}",
                               "parallel.activation_checkpoint=none")
        if compile:
            raise missing_plan(model, "ac_units", "parallel.compile", "parallel.compile=false")


def units(model: nn.Module) -> dict[str, int]:
    """``model``'s block units (path -> global index), or ``{}`` when it declares none."""
    fn = find_plan(model, "ac_units")
    return dict(fn()) if fn is not None else {}


def replace_submodule(model: nn.Module, path: str, new: nn.Module) -> None:
    """Put ``new`` at dotted ``path`` inside ``model`` (its parent keeps the child's name)."""
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)
