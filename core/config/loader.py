"""Load a config: TOML file + ``--set`` dotted overrides + plugin sections, validated with one-line errors."""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from crosstrain.config.schema import CORE_SECTIONS, Config
from crosstrain.config.toml_io import dumps_toml, parse_value, read_toml
from crosstrain.errors import ConfigError


def plugin_sections(manager: Any = None) -> dict[str, type[BaseModel]]:
    """``{name: model}`` from every plugin's ``crosstrain_config_sections`` hook (core names cannot be taken);
    ``manager``: ask another plugin manager than the process-wide one (:func:`crosstrain.pluginmanager.plugins_for`)."""
    from crosstrain import pluginmanager

    found: dict[str, type[BaseModel]] = {}
    for plugin_name, result in pluginmanager.call_each("crosstrain_config_sections", manager=manager):
        for name, model in (result or {}).items():
            if name in CORE_SECTIONS or name == "backend" or name in found:
                pluginmanager.record_error(plugin_name, f"config section {name!r} is already taken")
                continue
            if not (isinstance(model, type) and issubclass(model, BaseModel)):
                pluginmanager.record_error(plugin_name, f"config section {name!r} is not a pydantic model")
                continue
            found[name] = model
    return found


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one ``key.path=value`` override to the raw (unvalidated) config dict in place."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r} must look like section.key=value (e.g. --set optim.lr=3e-4)")
    path, text = item.split("=", 1)
    keys = [k.strip() for k in path.strip().split(".")]
    if not all(keys):
        raise ConfigError(f"--set {item!r}: {path!r} is not a dotted key such as optim.lr")
    node = raw
    for i, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item!r}: {'.'.join(keys[: i + 1])} is a value, not a section")
        node = child
    node[keys[-1]] = parse_value(text.strip())


def _allowed_keys(model: type[BaseModel]) -> list[str]:
    return [f.alias or name for name, f in model.model_fields.items()]


def _format_error(exc: ValidationError, prefix: str = "", model: type[BaseModel] | None = None) -> str:
    errors = exc.errors()
    err = errors[0]
    loc = [str(p) for p in err["loc"]]
    key = ".".join([prefix, *loc] if prefix else loc)
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    if err["type"] == "extra_forbidden":
        owner = model
        section = prefix
        if model is Config and len(loc) >= 2 and loc[0] in CORE_SECTIONS:
            owner, section = CORE_SECTIONS[loc[0]], loc[0]
        allowed = ", ".join(_allowed_keys(owner)) if owner is not None else "?"
        where = f"[{section}]" if section else "the top level"
        return f"unknown config key {key!r}; allowed keys in {where}: {allowed}{more}"
    got = err.get("input")
    got_text = json.dumps(got) if isinstance(got, (str, int, float, bool)) else type(got).__name__
    return f"invalid value for {key!r}: {err['msg']} (got {got_text}){more}"


def load_config(path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read ``path`` (or the defaults when None), apply overrides, validate core and plugin sections.

    Raises :class:`ConfigError` with one line naming the key and what is allowed.
    """
    raw: dict[str, Any] = read_toml(path) if path else {}
    for item in overrides:
        apply_override(raw, item)
    return config_from_dict(raw)


def config_from_dict(raw: dict[str, Any], sections: dict[str, type[BaseModel]] | None = None,
                     checks: bool = True) -> Config:
    """Validate a nested dict (as read from TOML) into a :class:`Config`: the plugins' ``sections`` (default: every
    plugin's), then, with ``checks``, :func:`check_static` (which builds the model family: torch)."""
    extra = plugin_sections() if sections is None else sections
    core_raw: dict[str, Any] = {}
    plugin_raw: dict[str, Any] = {}
    for key, value in raw.items():
        if key in extra:
            plugin_raw[key] = value
        elif key == "backend" or key in CORE_SECTIONS:
            core_raw[key] = value
        else:
            allowed = ", ".join(["backend", *CORE_SECTIONS, *extra])
            raise ConfigError(f"unknown config section {key!r}; allowed: {allowed}")
    try:
        config = Config.model_validate(core_raw)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc, model=Config)) from None
    plugins: dict[str, BaseModel] = {}
    for name, model in extra.items():
        value = plugin_raw.get(name, {})
        if not isinstance(value, dict):
            raise ConfigError(f"config section {name!r} must be a table, got {type(value).__name__}")
        try:
            plugins[name] = model.model_validate(value, context={"config": config})  # validators may read core
        except ValidationError as exc:
            raise ConfigError(_format_error(exc, prefix=name, model=model)) from None
    config.plugins = plugins
    if checks:
        from crosstrain.models.init_chain import inherit_tokenizer

        inherit_tokenizer(config)  # before the checks, which size the vocabulary by it
        check_static(config)
    return config


def _import_target(spec: str, key: str = "model.import_path") -> tuple[str, str]:
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"{key} {spec!r} must look like 'package.module:name'")
    return module, attr


def resolve_import_path(spec: str, key: str = "model.import_path") -> Any:
    """Import ``"pkg.mod:attr"`` (a callable); failures are a ConfigError naming the config key."""
    module_name, attr = _import_target(spec, key)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{key} {spec!r}: cannot import {module_name!r} ({exc}); check the name and "
                          "PYTHONPATH") from None
    target = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{key} {spec!r}: {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{key} {spec!r} is not callable")
    return target


def check_static(config: Config) -> None:
    """Checks that need no world size: batch/accumulation arithmetic, model preset and sequence length."""
    from crosstrain.models.family import family_for_run

    t, m = config.train, config.model
    if t.batch_size % t.grad_accum:
        raise ConfigError(f"train.batch_size={t.batch_size} must be divisible by train.grad_accum={t.grad_accum}")
    if 0 < config.schedule.total_steps < t.steps:
        raise ConfigError(f"schedule.total_steps={config.schedule.total_steps} is shorter than train.steps={t.steps}; "
                          "set schedule.total_steps >= train.steps, or 0 (= train.steps)")
    if m.import_path and m.init_from:
        raise ConfigError("model.init_from loads weights into the built-in GPT; it cannot be combined with "
                          "model.import_path (load them in your own build function instead)")
    if config.data.tokenizer and not config.data.path:
        raise ConfigError(f"data.tokenizer={config.data.tokenizer!r} needs a token file prepared with it: run "
                          f"'crosstrain data prepare [FILES] --tokenizer {config.data.tokenizer} --out data.bin' (no "
                          "files = the embedded corpus) and set data.path=data.bin")
    if m.import_path:
        _import_target(m.import_path)
    else:
        family = family_for_run(config)
        family.check(family.config_from_run(config), config)
    if config.data.path and not Path(config.data.path).is_file():
        if t.recipe != "lm":  # a recipe's own file (JSONL rows), not a token file
            raise ConfigError(f"data.path {config.data.path!r} does not exist; fix the path of the file recipe "
                              f"{t.recipe!r} reads, or leave data.path empty for its embedded data")
        raise ConfigError(f"data.path {config.data.path!r} does not exist; create it with 'crosstrain data prepare'")
    if config.precision.dtype == "fp16" and config.optim.offload:
        raise ConfigError("precision.dtype='fp16' cannot be combined with optim.offload=true; use bf16 or fp32")


def gpt_config(config: Config) -> Any:
    """The model config of the run's family (:mod:`crosstrain.models.family`): for the built-in GPT, the
    :class:`~crosstrain.models.gpt.GPTConfig` of ``model.preset`` with the model.* overrides (vocabulary from
    ``data.tokenizer`` when set), or of the ``model.init_from`` checkpoint."""
    from crosstrain.models.family import model_config

    return model_config(config)


def check_world(config: Config, world_size: int, memory_per_rank: int = 0) -> Any:
    """Checks that need the world size, the refusal rules (:mod:`crosstrain.config.rules`) among them; returns the
    resolved ``ParallelDims``. Raises ConfigError.

    ``memory_per_rank`` (bytes, 0 = unknown) lets ``parallel.layout = "auto"`` pick DDP where the training state
    fits comfortably (:mod:`crosstrain.parallel.layout`); the choice is ``dims.layout_choice``.
    """
    from crosstrain.parallel import ParallelDims
    from crosstrain.parallel import layout as layoutmod

    p = config.parallel
    dims = ParallelDims(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, tp=p.tp, pp=p.pp, ep=p.ep,
                        world_size=world_size)
    estimate = 0
    if not config.model.import_path and memory_per_rank > 0 and p.layout == "auto" and p.dp_shard == -1:
        micro = max(config.train.batch_size // max(world_size, 1) // config.train.grad_accum, 1)
        estimate = layoutmod.estimate_train_bytes(config, micro)
    choice = layoutmod.choose_layout(dims, p.layout, estimate, memory_per_rank)
    layoutmod.apply_layout(dims, choice)
    dims = dims.resolve() or dims
    dims.layout_choice = choice
    if not config.model.import_path:
        from crosstrain.models.family import family_for_run

        family = family_for_run(config)
        family.validate_parallel(family.config_from_run(config), dims)
    from crosstrain.config.rules import check_rules

    check_rules(config, dims)
    per_step = dims.dp_degree * config.train.grad_accum
    if config.train.batch_size % per_step:
        raise ConfigError(
            f"train.batch_size={config.train.batch_size} must be divisible by the data-parallel degree "
            f"({dims.dp_degree}) x train.grad_accum ({config.train.grad_accum}) = {per_step}"
        )
    return dims


def save_config(config: Config, folder: str | os.PathLike[str]) -> None:
    """Write the effective config as ``config.toml`` (each key's description, type and default as a comment above
    it) and ``config.json`` into ``folder``, each atomically
    (a reader, or a run killed mid-write, sees the old file or the new one, never half of one)."""
    from crosstrain.checkpoint.atomic import atomic_write
    from crosstrain.config.reference import comments

    data = config.to_dict()
    folder = Path(folder)
    notes = comments(config, {name: type(section) for name, section in config.plugins.items()})
    atomic_write(folder / "config.toml", dumps_toml(data, notes).encode())
    atomic_write(folder / "config.json", (json.dumps(data, indent=2) + "\n").encode())
