"""The k8s plugin's hook: ``crosstrain k8s``."""

from __future__ import annotations

import argparse

import crosstrain


@crosstrain.hookimpl
def crosstrain_add_commands(subparsers: argparse._SubParsersAction) -> None:
    from crosstrain.plugins.k8s.cli import add_commands

    add_commands(subparsers)
