"""A search space: ``[space]`` of a space file, one entry per config key, checked against the config schema
before any trial starts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from crosstrain.config.toml_io import read_toml
from crosstrain.errors import ConfigError
from crosstrain.plugins.tune.config import SearchSettings

#: the space file ``crosstrain tune`` uses when none is given (``crosstrain tune --example`` prints it)
EXAMPLE = "example_space.toml"


@dataclass(frozen=True)
class Param:
    """One searched key: a range (``low``..``high``, optionally ``log`` or on a ``step`` grid) or ``choices``."""

    key: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: tuple[Any, ...] = ()
    integer: bool = False

    def suggest(self, trial: Any) -> Any:
        """Optuna's ``suggest_*`` for this key."""
        if self.choices:
            return trial.suggest_categorical(self.key, list(self.choices))
        assert self.low is not None and self.high is not None
        if self.integer:
            return trial.suggest_int(self.key, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.key, float(self.low), float(self.high), step=self.step, log=self.log)

    def contains(self, value: Any) -> bool:
        """Whether ``value`` is a point of this space (so the base config can be its first trial)."""
        if self.choices:
            return value in self.choices
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        assert self.low is not None and self.high is not None
        if not self.low <= value <= self.high:
            return False
        if self.step:
            k = (value - self.low) / self.step
            return math.isclose(k, round(k), abs_tol=1e-9)
        return not self.integer or float(value).is_integer()

    def grid(self) -> list[Any]:
        """Every value, for the grid sampler (a continuous range without ``step`` has none)."""
        if self.choices:
            return list(self.choices)
        if not self.step or self.log:
            raise ConfigError(f"[space] {self.key!r}: sampler 'grid' needs choices or a step; add step = ... or "
                              "use sampler = 'tpe'")
        assert self.low is not None and self.high is not None
        n = int(math.floor((self.high - self.low) / self.step + 1e-9)) + 1
        values = [self.low + i * self.step for i in range(n)]
        return [int(v) for v in values] if self.integer else values


def as_set(key: str, value: Any) -> str:
    """``key=value`` as ``--set`` reads it (TOML values)."""
    if isinstance(value, bool):
        return f"{key}={'true' if value else 'false'}"
    if isinstance(value, float):
        return f"{key}={value!r}"
    if isinstance(value, str):
        return f'{key}="{value}"' if value == "" or any(c in value for c in " ,[]{}") else f"{key}={value}"
    return f"{key}={value}"


def parse_param(key: str, spec: Any) -> Param:
    where = f"[space] {key!r}"
    if not isinstance(spec, dict):
        raise ConfigError(f"{where} must be a table such as {{ low = 1e-4, high = 1e-2, log = true }} or "
                          "{ choices = [0.0, 0.1] }")
    unknown = set(spec) - {"low", "high", "log", "step", "choices"}
    if unknown:
        raise ConfigError(f"{where}: unknown field {sorted(unknown)[0]!r}; allowed: low, high, log, step, choices")
    if "choices" in spec:
        choices = spec["choices"]
        if not isinstance(choices, list) or not choices:
            raise ConfigError(f"{where}: choices is empty; list at least one value, e.g. choices = [0.0, 0.1]")
        if len(spec) > 1:
            raise ConfigError(f"{where}: choices cannot be combined with low/high/log/step; keep one of them")
        return Param(key, choices=tuple(choices))
    if "low" not in spec or "high" not in spec:
        raise ConfigError(f"{where} needs low and high (or choices)")
    low, high, step, log = spec["low"], spec["high"], spec.get("step"), bool(spec.get("log", False))
    numbers = [v for v in (low, high, step) if v is not None]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
        raise ConfigError(f"{where}: low, high and step must be numbers")
    if low > high:
        raise ConfigError(f"{where}: the range is empty (low = {low} > high = {high}); swap them")
    if step is not None and step <= 0:
        raise ConfigError(f"{where}: step = {step} must be > 0")
    if log and (low <= 0 or step is not None):
        raise ConfigError(f"{where}: log = true needs low > 0 and no step")
    integer = all(isinstance(v, int) for v in numbers)
    return Param(key, low=low, high=high, log=log, step=step, integer=integer)


def read_space(path: str | None) -> tuple[SearchSettings, list[Param], str]:
    """``(settings, params, name)`` of a space file (``None``: the example shipped with the plugin)."""
    from pydantic import ValidationError

    if path is None:
        text_path = resources.files("crosstrain.plugins.tune").joinpath(EXAMPLE)
        with resources.as_file(text_path) as p:
            raw, name = read_toml(p), "example"
    else:
        if not Path(path).is_file():
            raise ConfigError(f"space file {path!r} not found; write one (crosstrain tune --example > space.toml "
                              "prints a starting point) or leave it out to search the example space")
        raw, name = read_toml(path), Path(path).stem
    extra = set(raw) - {"tune", "space"}
    if extra:
        raise ConfigError(f"unknown table [{sorted(extra)[0]}] in the space file; allowed: [tune], [space]")
    try:
        settings = SearchSettings.model_validate(raw.get("tune", {}))
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ConfigError(f"[tune] {'.'.join(str(p) for p in err['loc'])}: {err['msg']}") from None
    space = raw.get("space", {})
    if not space:
        raise ConfigError("the space file has no [space] entries; add one, e.g. \"optim.lr\" = "
                          "{ low = 1e-4, high = 3e-3, log = true }")
    return settings, [parse_param(k, v) for k, v in space.items()], name


def check_keys(params: list[Param], base_sets: list[str], config_path: str | None = None) -> Any:
    """Load the base config with each key at its lowest value: an unknown key or a value the schema refuses is
    the config loader's one-line error, before any trial starts. Returns the base config."""
    from crosstrain.config import load_config

    base = load_config(config_path, base_sets)
    for p in params:
        value = p.choices[0] if p.choices else p.low
        try:
            load_config(config_path, [*base_sets, as_set(p.key, value)])
        except ConfigError as exc:
            raise ConfigError(f"[space] {p.key!r}: {exc}") from None
    return base


def base_value(config: Any, key: str) -> Any:
    """The base config's value of a dotted key (TOML names, as ``--set`` writes them); None if absent."""
    node: Any = config.to_dict()
    for part in key.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def sample(param: Param, rng: Any) -> Any:
    """A random point of ``param`` (``rng``: a ``random.Random``): uniform, log-uniform or one of the choices."""
    if param.choices:
        return rng.choice(param.choices)
    assert param.low is not None and param.high is not None
    if param.log:
        value = math.exp(rng.uniform(math.log(param.low), math.log(param.high)))
    else:
        value = rng.uniform(param.low, param.high)
    return snap(param, value)


def snap(param: Param, value: float) -> Any:
    """``value`` clipped into the range and onto its ``step`` grid (an int for an integer range)."""
    assert param.low is not None and param.high is not None
    value = min(max(value, param.low), param.high)
    if param.step:
        value = param.low + round((value - param.low) / param.step) * param.step
        value = min(value, param.high)
    return int(round(value)) if param.integer else float(value)


def distribution(param: Param) -> Any:
    """The Optuna distribution of ``param`` (to record trials the search did not ask Optuna for)."""
    import optuna

    if param.choices:
        return optuna.distributions.CategoricalDistribution(list(param.choices))
    if param.integer:
        return optuna.distributions.IntDistribution(int(param.low or 0), int(param.high or 0),
                                                    step=int(param.step or 1), log=param.log)
    return optuna.distributions.FloatDistribution(float(param.low or 0), float(param.high or 0), step=param.step,
                                                  log=param.log)
