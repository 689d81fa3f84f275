"""The export plugin's hooks: its own hook spec (``crosstrain_export_state_dict``), CLI commands,
the ``export`` config section and the after-train export."""

from __future__ import annotations

import argparse
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

import crosstrain


class ExportSection(BaseModel):
    """``[export]`` in a training config: what to export when training ends (written under ``<run dir>/export``)."""

    model_config = ConfigDict(extra="forbid")

    onnx: bool = False
    safetensors: bool = False
    int8: bool = False
    dir: str = "export"
    tolerance: float = Field(default=1e-4, gt=0)
    int8_tolerance: float = Field(default=1.0, gt=0)
    opset: int | None = None


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
    return {"export": ExportSection}


@crosstrain.hookimpl
def crosstrain_after_train(context: Any, run_dir: str) -> None:
    from crosstrain.plugins.export.after_train import export_after_train

    export_after_train(context, run_dir)
