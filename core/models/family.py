"""Model families: one bundle per family of models, in the spirit of torchtitan's ``ModelSpec``.

A :class:`ModelFamily` carries everything the rest of crosstrain asks about a kind of model: its config class and
presets, how to build it, how to read its config from a run's ``[model]`` section, the static and parallel checks,
parameter, FLOP and memory estimates, its Hugging Face state-dict adapters and the scalar-head swap of the RL/RM
recipes. Its parallel plans (``tp_plan``, ``pipeline_split``, ``ac_units``, see :mod:`crosstrain.parallel.plan`)
are methods of its modules or functions in :attr:`ModelFamily.parallel_plans`. Core code (config loading, the
layout choice, MFU) asks this registry and never imports a model.

The built-in ``gpt`` family (:mod:`crosstrain.models.gpt_family`) is always registered. A plugin adds a family,
or a :class:`FamilyExtension` to one (the MoE plugin's experts change the parameter and FLOP counts of the GPT
they transform), by returning it from the ``crosstrain_model_families`` hook. A run's family is the one whose
presets hold ``model.preset``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from crosstrain.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

    from crosstrain.models.hf.adapter import StateDictAdapter


@dataclass(frozen=True)
class ModelFamily:
    """One family of models. ``cfg`` below is an instance of :attr:`config_cls`; ``config`` a run's ``Config``.

    - ``build(cfg)``: the model, initialised on the current default device.
    - ``config_from_run(config)``: ``cfg`` from ``model.preset`` and the ``model.*`` overrides (or ``init_from``).
    - ``check(cfg, config)``: static checks (one-line :class:`ConfigError`), before any worker starts.
    - ``validate_parallel(cfg, dims)``: can ``dims`` (a resolved ``ParallelDims``) split this model?
    - ``param_count(cfg)``: parameters of the built model; ``flops_per_token(model, seq_len, inactive)``: training
      FLOPs per token of a built one whose ``inactive`` parameters a token never uses (unrouted experts);
      ``activation_bytes(cfg, micro_batch, seq_len)``: activations and logits one rank holds in a training step.
    - ``hf_adapters``: HF ``model_type`` -> :class:`~crosstrain.models.hf.adapter.StateDictAdapter`.
    - ``scalar_head(model, init)``: replace the LM head by a ``[dim -> 1]`` head in place (reward/value models).
    - ``parallel_plans``: ``{module class: {kind: fn}}`` registered with
      :func:`crosstrain.parallel.register_parallel_plan`, for classes that do not define the methods themselves.
    - ``claims(config)``: True when this family takes the run whatever ``model.preset`` says (the generic
      transformers path claims ``model.source = "transformers"`` and non-native ``model.init_from`` folders).
    - ``path`` (``"native"`` or ``"generic"``), ``refuses`` (the options it refuses, one short phrase each) and
      ``parallel_dims`` (the ``parallel.*`` dims above 1 it admits): what ``crosstrain models`` lists.
    """

    name: str
    config_cls: type
    presets: Mapping[str, Any]
    model_classes: tuple[type, ...]
    build: Callable[[Any], nn.Module]
    config_from_run: Callable[[Any], Any]
    check: Callable[[Any, Any], None]
    validate_parallel: Callable[[Any, Any], None]
    param_count: Callable[[Any], int]
    flops_per_token: Callable[[nn.Module, int, int], float]
    activation_bytes: Callable[[Any, int, int], int]
    hf_adapters: Mapping[str, StateDictAdapter] = field(default_factory=dict)
    scalar_head: Callable[[nn.Module, str], None] | None = None
    parallel_plans: Mapping[type, Mapping[str, Callable[..., Any]]] = field(default_factory=dict)
    claims: Callable[[Any], bool] | None = None
    path: str = "native"
    refuses: tuple[str, ...] = ()
    parallel_dims: tuple[str, ...] = ("dp_replicate", "dp_shard", "tp", "pp")


@dataclass(frozen=True)
class FamilyExtension:
    """What a plugin that transforms a family's models changes in its estimates (MoE: experts).

    ``extra_params(cfg, config)``: parameters the transform adds to a model of config ``cfg`` in the run ``config``
    (0 when the plugin is off); ``inactive_params(model)``: parameters of a built model a token does not use;
    ``parallel_dims``: the ``parallel.*`` dims it adds to the family's (``crosstrain models``);
    ``hf_adapters``: HF ``model_type`` -> adapter of the checkpoints the transformed models import and export.
    """

    name: str
    family: str
    extra_params: Callable[[Any, Any], int]
    inactive_params: Callable[[nn.Module], int]
    parallel_dims: tuple[str, ...] = ()
    hf_adapters: Mapping[str, StateDictAdapter] = field(default_factory=dict)


_FAMILIES: dict[str, ModelFamily] = {}  # registered in-process with register_family
_EXTENSIONS: dict[tuple[str, str], FamilyExtension] = {}
_PLANNED: set[int] = set()  # ids of the families whose parallel_plans are registered
_REPORTED: set[tuple[str, str]] = set()  # (plugin, problem) already recorded: the registry is read many times


def _clash(found: Mapping[str, ModelFamily], family: ModelFamily) -> str:
    """Why ``family`` cannot join ``found`` (two families may not share a name or a preset), or ``""``."""
    old = found.get(family.name)
    if old is not None and old is not family:
        return f"model family {family.name!r} is already registered; give the new family another name"
    for other in found.values():
        taken = sorted(set(other.presets) & set(family.presets)) if other is not family else []
        if taken:
            return f"model family {family.name!r}: preset {taken[0]!r} belongs to family {other.name!r}; rename it"
    return ""


def _with_plans(family: ModelFamily) -> ModelFamily:
    if id(family) not in _PLANNED and family.parallel_plans:
        from crosstrain.parallel.plan import register_parallel_plan

        for cls, plans in family.parallel_plans.items():
            register_parallel_plan(cls, **plans)
    _PLANNED.add(id(family))
    return family


def register_family(family: ModelFamily) -> None:
    """Add ``family`` in-process (a plugin returns it from ``crosstrain_model_families`` instead)."""
    problem = _clash(families(), family)
    if problem:
        raise ConfigError(problem)
    _FAMILIES[family.name] = _with_plans(family)


def register_extension(extension: FamilyExtension) -> None:
    """Add ``extension`` in-process (a plugin returns it from ``crosstrain_model_families`` instead)."""
    _EXTENSIONS[(extension.family, extension.name)] = extension


def _collect() -> tuple[dict[str, ModelFamily], list[FamilyExtension]]:
    """The built-in family, the in-process ones, then what plugins return from ``crosstrain_model_families`` now
    (a plugin unregistered later takes its family with it); a clashing one is reported as that plugin's error."""
    from crosstrain import pluginmanager
    from crosstrain.models.generic.family import GENERIC_FAMILY
    from crosstrain.models.gpt_family import GPT_FAMILY

    found = {GPT_FAMILY.name: GPT_FAMILY, GENERIC_FAMILY.name: GENERIC_FAMILY, **_FAMILIES}
    exts = dict(_EXTENSIONS)
    problems: list[tuple[str, str]] = []
    for plugin_name, result in pluginmanager.call_each("crosstrain_model_families"):
        for item in result or ():
            if isinstance(item, ModelFamily):
                problem = _clash(found, item)
                if problem:
                    problems.append((plugin_name, problem))
                else:
                    found[item.name] = _with_plans(item)
            elif isinstance(item, FamilyExtension):
                exts[(item.family, item.name)] = item
            else:
                what = type(item).__name__
                problems.append(
                    (plugin_name, f"crosstrain_model_families returned {what}, not a ModelFamily or FamilyExtension")
                )
    for plugin_name, problem in problems:
        if (plugin_name, problem) not in _REPORTED:
            _REPORTED.add((plugin_name, problem))
            pluginmanager.record_error(plugin_name, problem)
    return found, list(exts.values())


def families() -> dict[str, ModelFamily]:
    """Every registered family by name (the built-in ``gpt`` first)."""
    return _collect()[0]


def get_family(name: str) -> ModelFamily:
    found = families()
    if name not in found:
        raise ConfigError(f"unknown model family {name!r}; registered: {', '.join(found)}")
    return found[name]


def extensions(family: str) -> list[FamilyExtension]:
    """The extensions registered for ``family``."""
    return [ext for ext in _collect()[1] if ext.family == family]


def family_for_preset(preset: str) -> ModelFamily:
    """The family whose presets hold ``preset`` (``model.preset``); an unknown name lists them all."""
    found = families()
    for fam in found.values():
        if preset in fam.presets:
            return fam
    allowed = [name for fam in found.values() for name in fam.presets]
    raise ConfigError(f"unknown model.preset {preset!r}; allowed: {', '.join(allowed)}")


def family_for_run(config: Any) -> ModelFamily:
    """The family of a run: the first that :attr:`~ModelFamily.claims` it (``model.source``), else the one whose
    presets hold ``model.preset``."""
    for fam in families().values():
        if fam.claims is not None and fam.claims(config):
            return fam
    return family_for_preset(config.model.preset)


def native_model_types() -> dict[str, str]:
    """Hugging Face ``model_type`` -> the native family that imports it (``model.source = "auto"`` picks it)."""
    found, exts = _collect()
    native = {name for name, fam in found.items() if fam.path == "native"}
    out = {mt: fam.name for fam in found.values() if fam.name in native for mt in fam.hf_adapters}
    out.update({mt: ext.family for ext in exts if ext.family in native for mt in ext.hf_adapters})
    return out


def new_scalar_head(dim: int, init: str) -> nn.Module:
    """``Linear(dim, 1)`` without bias, the head a family's ``scalar_head`` puts on reward/value models: torch's
    default init first (as the recipes always drew it), then ``normal`` (std ``dim ** -0.5``), ``zeros`` or kept
    (``default``)."""
    from torch import nn  # the registry itself imports no torch

    head = nn.Linear(dim, 1, bias=False)
    if init == "normal":
        nn.init.normal_(head.weight, std=dim**-0.5)
    elif init == "zeros":
        nn.init.zeros_(head.weight)
    elif init != "default":
        raise ValueError(f"scalar head init {init!r}; use 'normal', 'zeros' or 'default'")
    return head


def family_of(model: nn.Module) -> ModelFamily | None:
    """The family whose model classes ``model`` is an instance of, or None (a ``model.import_path`` model)."""
    for fam in families().values():
        if isinstance(model, fam.model_classes):
            return fam
    return None


def model_config(config: Any) -> Any:
    """The model config of a run (``config.model``) that builds a registered family's model."""
    return family_for_run(config).config_from_run(config)


def param_count(config: Any) -> int:
    """Parameters of the run's model, with what plugins' transforms add (MoE experts), without building it."""
    fam = family_for_run(config)
    cfg = fam.config_from_run(config)
    return fam.param_count(cfg) + sum(ext.extra_params(cfg, config) for ext in extensions(fam.name))


def flops_per_token(model: nn.Module, seq_len: int) -> float | None:
    """Training FLOPs per token of a registered family's ``model`` (parameters a token does not use, such as
    unrouted experts, left out); None for a model of no family."""
    fam = family_of(model)
    if fam is None:
        return None
    inactive = sum(ext.inactive_params(model) for ext in extensions(fam.name))
    return float(fam.flops_per_token(model, seq_len, inactive))


def hf_adapter(model_type: str) -> StateDictAdapter:
    """The state-dict adapter of a Hugging Face ``model_type``, from whichever family or extension registered it."""
    known: dict[str, StateDictAdapter] = {}
    found, exts = _collect()
    for fam in found.values():
        known.update(fam.hf_adapters)
    for ext in exts:
        known.update(ext.hf_adapters)
    if model_type not in known:
        raise ConfigError(
            f"Hugging Face model_type {model_type!r} has no state-dict adapter; supported: {', '.join(known)}"
        )
    return known[model_type]


def swap_scalar_head(model: nn.Module, init: str, *, who: str) -> nn.Module:
    """Replace ``model``'s LM head by a scalar ``[dim -> 1]`` head in place (reward and value models) and return it.

    ``init``: ``"normal"`` (a reward model), ``"zeros"`` (a value model that starts at V = 0) or ``"default"``
    (weights loaded next). ``who`` names the caller in the error for a model of no family with a scalar head.
    """
    fam = family_of(model)
    if fam is None or fam.scalar_head is None:
        raise ConfigError(
            f"{who} needs the built-in GPT (it replaces the LM head with a scalar head), not "
            f"{type(model).__name__}; unset model.import_path"
        )
    fam.scalar_head(model, init)
    return model
