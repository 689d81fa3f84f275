"""The federated-learning plugin's hooks: ``crosstrain fl ...``, the ``[fl]`` section, the client's recipe."""

from __future__ import annotations

import argparse
from typing import Any

import crosstrain


@crosstrain.hookimpl
def crosstrain_add_commands(subparsers: argparse._SubParsersAction) -> None:
    from crosstrain.plugins.fl.cli import add_commands

    add_commands(subparsers)


@crosstrain.hookimpl
def crosstrain_config_sections() -> dict[str, type]:
    from crosstrain.plugins.fl.config import FLSection

    return {"fl": FLSection}


@crosstrain.hookimpl
def crosstrain_recipe(name: str) -> Any:
    if name != "fl_client":
        return None
    from crosstrain.errors import ConfigError

    # `crosstrain fl client` hands its recipe instance to the Trainer; by name there is no server to train for
    raise ConfigError("train.recipe='fl_client' runs only under `crosstrain fl client` (it needs a server)")


@crosstrain.hookimpl
def crosstrain_recipe_names() -> list[str]:
    return ["fl_client"]


@crosstrain.hookimpl
def crosstrain_refusal_rules() -> list[Any]:
    from crosstrain.plugins.fl.rules import RULES

    return list(RULES)
