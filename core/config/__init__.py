"""Configuration: pydantic sections, TOML files, ``--set`` overrides and plugin sections."""

from crosstrain.config.loader import (
    apply_override,
    check_static,
    check_world,
    config_from_dict,
    gpt_config,
    load_config,
    resolve_import_path,
    save_config,
)
from crosstrain.config.schema import CORE_SECTIONS, Config

__all__ = [
    "CORE_SECTIONS",
    "Config",
    "apply_override",
    "check_static",
    "check_world",
    "config_from_dict",
    "gpt_config",
    "load_config",
    "resolve_import_path",
    "save_config",
]
