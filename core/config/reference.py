"""The configuration as a reference: every key of every section (core and plugins') with its value, default, type
and description, read from the pydantic fields themselves (``crosstrain config show``, the comments of a run's
config.toml). Nothing here imports torch."""

from __future__ import annotations

import json
import types
from dataclasses import asdict, dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from crosstrain.config.schema import CORE_SECTIONS, Config


@dataclass(frozen=True)
class KeyInfo:
    """One config key: ``key`` dotted (``checkpoint.async``, ``backend``), its effective ``value``."""

    key: str
    section: str
    type: str
    default: Any
    value: Any
    description: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _type_text(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _type_text(args[0])
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin is Union or origin is types.UnionType:
        return " | ".join(_type_text(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_text(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def type_name(field: FieldInfo) -> str:
    """The annotation as a reader writes it: ``int``, ``'auto' | bool``, ``tuple[float, float]``."""
    return _type_text(field.annotation)


def default_of(field: FieldInfo) -> Any:
    if field.default is not PydanticUndefined:
        return field.default
    if field.default_factory is not None:
        return field.default_factory()  # type: ignore[call-arg]
    return None


def _json_value(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", by_alias=True)
    if isinstance(value, tuple):
        return list(value)
    return value


def section_keys(name: str, model: type[BaseModel], section: BaseModel | None = None) -> list[KeyInfo]:
    """The keys of section ``name`` (its TOML names: the alias when a field has one), values from ``section``."""
    out = []
    for attr, field in model.model_fields.items():
        toml_name = field.alias or attr
        default = _json_value(default_of(field))
        value = _json_value(getattr(section, attr)) if section is not None else default
        out.append(KeyInfo(f"{name}.{toml_name}", name, type_name(field), default, value,
                           (field.description or "").strip()))
    return out


def describe(config: Config, sections: dict[str, type[BaseModel]]) -> list[KeyInfo]:
    """Every key of ``config``: ``backend``, the core sections in config.toml's order, then the plugins' ``sections``
    (``{name: model}``, as :func:`crosstrain.config.loader.plugin_sections` returns them)."""
    backend = Config.model_fields["backend"]
    keys = [KeyInfo("backend", "", type_name(backend), default_of(backend), config.backend,
                    (backend.description or "").strip())]
    for name, model in CORE_SECTIONS.items():
        keys += section_keys(name, model, getattr(config, name))
    for name, model in sections.items():
        keys += section_keys(name, model, config.plugins.get(name))
    return keys


def comments(config: Config, sections: dict[str, type[BaseModel]]) -> dict[str, str]:
    """``{dotted key: "description (type, default D)"}``: the comments of a run's config.toml."""
    out = {}
    for info in describe(config, sections):
        default = "unset" if info.default is None else json.dumps(info.default)
        out[info.key] = f"{info.description} ({info.type}, default {default})" if info.description \
            else f"({info.type}, default {default})"
    return out
