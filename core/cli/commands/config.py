"""``crosstrain config show [CONFIG] [--set K=V ...] [--recipe R] [--json]`` and ``crosstrain config explain KEY``:
the effective configuration with every key's default, type and description, the plugins' sections included.

Only the plugins that add config sections are imported (not the backends), so neither command loads torch."""

from __future__ import annotations

import argparse
import difflib
import json
from typing import Any


def _effective(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The validated config of ``args`` (file, ``--set``, ``--recipe``) and the plugins' sections."""
    from crosstrain import pluginmanager
    from crosstrain.config.loader import apply_override, config_from_dict, plugin_sections
    from crosstrain.config.toml_io import read_toml

    raw: dict[str, Any] = read_toml(args.config) if getattr(args, "config", None) else {}
    overrides = [*(getattr(args, "set", None) or []), *([f"train.recipe={args.recipe}"] if args.recipe else [])]
    for item in overrides:
        apply_override(raw, item)
    sections = plugin_sections(pluginmanager.plugins_for("crosstrain_config_sections"))
    # checks=False: the keys are what is shown; the run's own checks (which build the model) stay with `train`
    return config_from_dict(raw, sections=sections, checks=False), sections


def _keys(args: argparse.Namespace) -> list[Any]:
    from crosstrain.config.reference import describe

    config, sections = _effective(args)
    return describe(config, sections)


def show(args: argparse.Namespace) -> int:
    keys = _keys(args)
    if args.json:
        print(json.dumps({"keys": [k.as_dict() for k in keys]}, indent=1))
        return 0
    section = None
    for k in keys:
        if k.section != section:
            section = k.section
            print(f"\n[{section}]" if section else "# top level")
        name = k.key.rsplit(".", 1)[-1]
        changed = "" if k.value == k.default else f"  (default {json.dumps(k.default)})"
        print(f"{name} = {json.dumps(k.value)}{changed}  # {k.type}: {k.description}")
    return 0


def explain(args: argparse.Namespace) -> int:
    from crosstrain.errors import ConfigError

    keys = {k.key: k for k in _keys(args)}
    info = keys.get(args.key)
    if info is None:
        close = difflib.get_close_matches(args.key, list(keys), n=3) or \
            [k for k in keys if k.startswith(args.key + ".")][:3]
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"unknown config key {args.key!r}{hint} ('crosstrain config show' lists every key)")
    if args.json:
        print(json.dumps(info.as_dict()))
        return 0
    print(f"{info.key}: {info.type}, default {json.dumps(info.default)}")
    print(f"  {info.description}")
    if info.value != info.default:
        print(f"  effective value: {json.dumps(info.value)}")
    return 0


def _add_effective_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key, e.g. --set optim.lr=3e-4")
    p.add_argument("--recipe", default=None, metavar="NAME", help="same as --set train.recipe=NAME")
    p.add_argument("--json", action="store_true", help="print JSON")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="print the configuration: every key's value, default, type and description")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    s = csub.add_parser("show", help="the effective configuration, every section (plugins' included)",
                        description="Every key with its effective value, type and description; a key that differs "
                                    "from its default shows the default too.")
    s.add_argument("config", nargs="?", default=None, help="TOML config file (optional)")
    _add_effective_args(s)
    s.set_defaults(func=show)
    e = csub.add_parser("explain", help="one key: its type, default and description")
    e.add_argument("key", help="a dotted key, e.g. checkpoint.every")
    e.add_argument("config", nargs="?", default=None, help="TOML config file (optional)")
    _add_effective_args(e)
    e.set_defaults(func=explain)
