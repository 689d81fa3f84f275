"""The tune plugin's hooks: the run-side ``[tune]`` section, ``crosstrain tune`` and the pruning report."""

from __future__ import annotations

import argparse
from typing import Any

import crosstrain


@crosstrain.hookimpl
def crosstrain_config_sections() -> dict[str, type]:
    from crosstrain.plugins.tune.config import TuneRunSection

    return {"tune": TuneRunSection}


@crosstrain.hookimpl
def crosstrain_add_commands(subparsers: argparse._SubParsersAction) -> None:
    from crosstrain.plugins.tune.cli import add_commands

    add_commands(subparsers)


@crosstrain.hookimpl
def crosstrain_on_step_end(context: Any, step: int, metrics: dict[str, float]) -> None:
    if context.config.section("tune").trial < 0:
        return  # not a trial of a search
    from crosstrain.plugins.tune.pruning import report

    report(context, step, metrics)
