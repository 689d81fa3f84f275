"""The export plugin's hooks: its own hook spec (``crosstrain_export_state_dict``), CLI commands,
the ``export`` config section and the after-train export."""

from __future__ import annotations

import argparse
from typing import Any

import crosstrain


@crosstrain.hookimpl
def crosstrain_add_hookspecs(pluginmanager: Any) -> None:
    from crosstrain.plugins.export import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


@crosstrain.hookimpl
def crosstrain_add_commands(subparsers: argparse._SubParsersAction) -> None:
    from crosstrain.plugins.export.cli import add_commands

    add_commands(subparsers)


@crosstrain.hookimpl
def crosstrain_config_sections() -> dict[str, type]:
    from crosstrain.plugins.export.config import ExportSection

    return {"export": ExportSection}


@crosstrain.hookimpl
def crosstrain_after_train(context: Any, run_dir: str) -> None:
    from crosstrain.plugins.export.after_train import export_after_train

    export_after_train(context, run_dir)
