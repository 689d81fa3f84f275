"""The ``crosstrain`` command line: core subcommands plus those plugins add through the hook."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import warnings
from collections.abc import Sequence
from typing import NoReturn

from crosstrain import __version__
from crosstrain.checkpoint.atomic import says_no_space
from crosstrain.checkpoint.space import NoSpaceError
from crosstrain.errors import CrosstrainError, first_line
from crosstrain.fault.peer_loss import EXIT_PEER_LOST, is_peer_loss

#: core subcommand modules under ``crosstrain.cli.commands``; each defines ``add_parser(subparsers)``.
CORE_COMMANDS = ("train", "eval", "data", "tokenizer", "checkpoint", "backends", "plugins", "kernels",
                 "doctor", "models", "config", "slurm")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors, like every other crosstrain error (subcommands inherit it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"crosstrain: error: {self.prog}: {message} (see '{self.prog} --help')\n")


def _needs_plugin_commands(argv: Sequence[str] | None) -> bool:
    """Whether parsing ``argv`` needs the plugins' commands: always but for ``crosstrain --version``, since a plugin
    may add flags to a core command too (``train --profile-steps``). Only the plugins that add commands are imported,
    and their CLI modules import nothing heavy (tests/test_cli_startup.py)."""
    if argv is None:
        return True
    return not ("--version" in argv and all(a.startswith("-") for a in argv))


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of ``crosstrain``; with ``argv``, what parsing it needs (see :func:`_needs_plugin_commands`).
    Every command module imports its heavy dependencies (torch, transformers) inside the function that runs it."""
    parser = _Parser(prog="crosstrain", description="Train on whatever accelerator you have.")
    parser.add_argument("--version", action="version", version=f"crosstrain {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log plugin discovery and backend choice")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in CORE_COMMANDS:
        module_name = f"crosstrain.cli.commands.{name}"
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # command not shipped in this build
                continue
            raise
        module.add_parser(sub)
    if _needs_plugin_commands(argv):
        from crosstrain import pluginmanager

        commands = pluginmanager.plugins_for("crosstrain_add_commands")  # not the backends: no torch
        pluginmanager.call_each("crosstrain_add_commands", subparsers=sub, manager=commands)
    return parser


def _format_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                    line: str | None = None) -> str:
    """crosstrain's own warnings (a skipped corrupt checkpoint, ...) read as one line, like its errors."""
    if category.__module__.startswith("crosstrain"):
        return f"crosstrain: warning: {message}\n"
    return _python_format_warning(message, category, filename, lineno, line)


_python_format_warning = warnings.formatwarning


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    warnings.formatwarning = _format_warning
    logging.basicConfig(level=logging.INFO if "-v" in args_list or "--verbose" in args_list else logging.ERROR,
                        format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser(args_list)
    args = parser.parse_args(args_list)
    args.cli_argv = args_list  # what a command that stops early names in its resume hint (crosstrain train)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except CrosstrainError as exc:
        print(f"crosstrain: error: {exc}", file=sys.stderr)
        return EXIT_PEER_LOST if is_peer_loss(exc) else int(getattr(exc, "exit_code", 1))
    except Exception as exc:
        if is_peer_loss(exc):
            print(f"crosstrain: error: lost another rank ({first_line(exc)}); its own output above shows why it "
                  "stopped", file=sys.stderr)
            return EXIT_PEER_LOST
        if not says_no_space(exc):
            raise
        # a full disk met by a writer that does not name its file (a library copying into a temp folder)
        print(f"crosstrain: error: no space left on device ({first_line(exc)}); free some space or write to "
              "another disk", file=sys.stderr)
        return NoSpaceError.exit_code
    except KeyboardInterrupt:
        print("crosstrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
