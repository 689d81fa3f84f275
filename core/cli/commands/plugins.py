"""``crosstrain plugins``: every loaded plugin with the recipes, config sections, backends and hooks it brings,
and the plugins that failed to load."""

from __future__ import annotations

import argparse
import inspect
import json
from typing import Any

from crosstrain import pluginmanager


def _own_result(hook_impls: dict[str, Any], hook: str, plugin_name: str) -> Any:
    """What this plugin's own implementation of ``hook`` returns (None without one; a raise is a plugin error)."""
    impl = hook_impls.get(hook)
    if impl is None:
        return None
    try:
        return impl.function()
    except Exception as exc:
        pluginmanager.record_error(plugin_name, exc)
        return None


def _source(plugin: Any) -> str:
    module = inspect.getmodule(plugin)
    if inspect.ismodule(plugin) or module is None:
        return getattr(plugin, "__name__", type(plugin).__name__)
    return f"{module.__name__}.{type(plugin).__qualname__}"


def collect() -> dict[str, Any]:
    """``{"plugins": [...], "plugin_errors": [...]}``: the built-in recipes as plugin ``core``, then each loaded
    plugin in registration order (the order its hooks are called in)."""
    from crosstrain.engine.recipe import builtin_recipes

    pm = pluginmanager.plugin_manager()
    plugins: list[dict[str, Any]] = [{"name": "core", "source": "crosstrain", "recipes": list(builtin_recipes()),
                                      "config_sections": [], "backends": [], "hooks": []}]
    for name, plugin in pm.list_name_plugin():
        if plugin is None:  # blocked
            continue
        hook_impls = {caller.name: impl for caller in pm.get_hookcallers(plugin) or []
                      for impl in caller.get_hookimpls() if impl.plugin is plugin}
        plugins.append({
            "name": name,
            "source": _source(plugin),
            "recipes": list(_own_result(hook_impls, "crosstrain_recipe_names", name) or []),
            "config_sections": sorted(_own_result(hook_impls, "crosstrain_config_sections", name) or {}),
            "backends": [b.name for b in _own_result(hook_impls, "crosstrain_register_backends", name) or []],
            "hooks": sorted(hook_impls),
        })
    errors = [{"plugin": e.name, "error": e.error} for e in pluginmanager.load_errors()]
    return {"plugins": plugins, "plugin_errors": errors}


def run(args: argparse.Namespace) -> int:
    data = collect()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    for p in data["plugins"]:
        print(f"{p['name']} ({p['source']})")
        for label, key in (("recipes", "recipes"), ("config sections", "config_sections"),
                           ("backends", "backends"), ("hooks", "hooks")):
            if p[key]:
                print(f"  {label}: {', '.join(p[key])}")
    for e in data["plugin_errors"]:
        print(f"plugin {e['plugin']} failed: {e['error']}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plugins", help="list loaded plugins: their recipes, config sections, backends and hooks")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
