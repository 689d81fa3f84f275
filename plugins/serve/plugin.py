"""The serve plugin's hooks: the ``crosstrain serve`` command."""

from __future__ import annotations

import argparse

import crosstrain


@crosstrain.hookimpl
def crosstrain_add_commands(subparsers: argparse._SubParsersAction) -> None:
    from crosstrain.plugins.serve.cli import add_command

    add_command(subparsers)
