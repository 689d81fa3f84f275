"""The plugin manager: loads every plugin registered under the ``crosstrain`` entry-point group.

A plugin that fails to import is recorded in :func:`load_errors` and skipped; it never breaks
``import crosstrain`` or the other plugins.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

import pluggy

from crosstrain import hookspecs

log = logging.getLogger("crosstrain.plugins")

ENTRY_POINT_GROUP = "crosstrain"


@dataclass(frozen=True)
class PluginLoadError:
    """A plugin that could not be loaded or whose hook raised."""

    name: str
    error: str


_lock = threading.Lock()
_manager: pluggy.PluginManager | None = None
_errors: list[PluginLoadError] = []


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if pm.has_plugin(ep.name) or pm.is_blocked(ep.name):
            continue
        try:
            plugin = ep.load()
            pm.register(plugin, name=ep.name)
        except Exception as exc:
            record_error(ep.name, exc)


def record_error(name: str, exc: BaseException | str) -> None:
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    _errors.append(PluginLoadError(name, text))
    log.warning("crosstrain plugin %r failed: %s", name, text)


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, created and populated on first use."""
    global _manager
    with _lock:
        if _manager is None:
            pm = pluggy.PluginManager(hookspecs.PROJECT)
            pm.add_hookspecs(hookspecs)
            _load_entry_points(pm)
            _manager = pm
        return _manager


def register(plugin: Any, name: str | None = None) -> None:
    """Register a plugin object or module in-process (tests, notebooks); clears cached discoveries."""
    plugin_manager().register(plugin, name=name)
    _invalidate()


def unregister(name: str) -> None:
    pm = plugin_manager()
    plugin = pm.get_plugin(name)
    if plugin is not None:
        pm.unregister(plugin)
    _invalidate()


def load_errors() -> list[PluginLoadError]:
    plugin_manager()
    return list(_errors)


def ordered_impls(hook_name: str) -> list[Any]:
    """A hook's implementations in call order: ``tryfirst`` ones, then the rest in registration order (first
    registered first), then ``trylast`` ones. pluggy itself calls last-registered first; crosstrain
    documents and uses registration order, so model transforms apply in the order plugins were added."""
    impls = [i for i in getattr(plugin_manager().hook, hook_name).get_hookimpls() if not (i.hookwrapper or i.wrapper)]
    first = [i for i in impls if i.tryfirst]
    last = [i for i in impls if i.trylast]
    return first + [i for i in impls if not (i.tryfirst or i.trylast)] + last


def call_each(hook_name: str, *, on_error: Callable[[str, BaseException], None] | None = None,
              **kwargs: Any) -> list[tuple[str, Any]]:
    """Call a hook on every plugin separately, so one raising plugin is reported and the rest still run.

    Returns ``(plugin_name, result)`` for every implementation that returned without raising, in
    :func:`ordered_impls` order; ``on_error(plugin_name, exc)`` hears of each one that raised.
    """
    results: list[tuple[str, Any]] = []
    for impl in ordered_impls(hook_name):
        args = {k: kwargs[k] for k in impl.argnames}
        try:
            results.append((impl.plugin_name, impl.function(**args)))
        except Exception as exc:
            record_error(impl.plugin_name, exc)
            if on_error is not None:
                on_error(impl.plugin_name, exc)
    return results


def call_strict(hook_name: str, what: str, **kwargs: Any) -> list[tuple[str, Any]]:
    """Call a hook on every plugin in :func:`ordered_impls` order; a raising plugin stops the run (PluginError).

    For run-time hooks whose silent failure would change what training does (gradient transforms for secure
    aggregation or differential privacy, extra checkpoint state, after-train exports). ``what`` completes the
    message "plugin X failed to ...".
    """
    from crosstrain.errors import CrosstrainError, PluginError

    results: list[tuple[str, Any]] = []
    for impl in ordered_impls(hook_name):
        args = {k: kwargs[k] for k in impl.argnames}
        try:
            results.append((impl.plugin_name, impl.function(**args)))
        except CrosstrainError:
            raise
        except Exception as exc:
            raise PluginError(f"plugin {impl.plugin_name!r} failed to {what}: {type(exc).__name__}: {exc}") from exc
    return results


def _invalidate() -> None:
    from crosstrain import registry

    registry.reset()
