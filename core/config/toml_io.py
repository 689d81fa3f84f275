"""Minimal TOML reading (tomllib/tomli) and writing for configs: scalars, lists (of inline tables too) and nested
tables, with comments."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from crosstrain.errors import ConfigError

TOMLDecodeError = tomllib.TOMLDecodeError


def read_toml(path: str | Path) -> dict[str, Any]:
    """Parse a TOML file; a missing or malformed file is a :class:`ConfigError` naming it."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist; pass an existing TOML file or none")
    try:
        with p.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {str(p)!r} is not text (TOML is UTF-8); pass a TOML config file") from None


def parse_value(text: str) -> Any:
    """A ``--set`` value as TOML (``3e-4``, ``true``, ``[1, 2]``, ``"x"``), else the raw string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_scalar(v) for v in value if v is not None) + "]"
    if isinstance(value, dict):  # a table inside a list (vision.augment): inline
        return "{" + ", ".join(f"{_key(k)} = {_scalar(v)}" for k, v in value.items() if v is not None) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def _comment(lines: list[str], comments: dict[str, str], path: str) -> None:
    text = " ".join(comments.get(path, "").split())
    if text:
        lines.append(f"# {text}")


def _table(lines: list[str], prefix: str, data: dict[str, Any], comments: dict[str, str], path: str = "") -> None:
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    for key, value in data.items():
        if value is None or isinstance(value, dict):
            continue  # TOML has no null: unset optional keys are omitted
        _comment(lines, comments, f"{path}.{key}" if path else key)
        lines.append(f"{_key(key)} = {_scalar(value)}")
    for key, value in tables.items():
        name = f"{prefix}.{_key(key)}" if prefix else _key(key)
        lines.append("")
        if path:  # a section's own comment would say nothing; a table inside one (model.options) has its key's
            _comment(lines, comments, f"{path}.{key}")
        lines.append(f"[{name}]")
        _table(lines, name, value, comments, f"{path}.{key}" if path else key)


def _key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else json.dumps(key)


def dumps_toml(data: dict[str, Any], comments: dict[str, str] | None = None) -> str:
    """Serialise nested dicts to TOML text (``None`` values are left out); ``comments`` (``{dotted key: text}``)
    go above their keys as ``# text`` lines, so the file reads as its own reference and parses the same."""
    lines: list[str] = []
    _table(lines, "", data, comments or {})
    return "\n".join(lines).lstrip("\n") + "\n"
