"""The plugin manager: loads every plugin registered under the ``crosstrain`` entry-point group.

A plugin that fails to import is recorded in :func:`load_errors` and skipped; it never breaks
``import crosstrain`` or the other plugins. Nothing is imported until a hook is first called: ``import crosstrain``
and the CLI's start read only the entry points' names (:mod:`importlib.metadata`), and the CLI's parser imports
only the plugins whose module names ``crosstrain_add_commands`` (:func:`plugins_for`).
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any, cast

import pluggy
from pluggy import HookImpl

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


def _entry_points() -> list[EntryPoint]:
    return sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)


def _load_entry_points(pm: pluggy.PluginManager, only: Callable[[EntryPoint], bool] = lambda ep: True) -> None:
    for ep in _entry_points():
        if pm.has_plugin(ep.name) or pm.is_blocked(ep.name) or not only(ep):
            continue
        try:
            plugin = ep.load()
            pm.register(plugin, name=ep.name)
        except Exception as exc:
            record_error(ep.name, exc)


def record_error(name: str, exc: BaseException | str) -> None:
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    if PluginLoadError(name, text) in _errors:  # the CLI's parser and the run both tried to load it
        return
    _errors.append(PluginLoadError(name, text))
    log.warning("crosstrain plugin %r failed: %s", name, text)


def _new_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.hook.crosstrain_add_hookspecs.call_historic(kwargs={"pluginmanager": pm})
    return pm


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, created and populated on first use."""
    global _manager
    with _lock:
        if _manager is None:
            pm = _new_manager()
            _load_entry_points(pm)
            _manager = pm
        return _manager


def names_hook(ep: EntryPoint, hook_name: str) -> bool:
    """Whether the module behind ``ep`` may implement ``hook_name``: its source text names the hook (an
    implementation, an import of one or a ``specname=``), read without importing it. A module without readable
    source counts as implementing it, so a plugin is never left out, only imported when it need not be."""
    try:
        spec = importlib.util.find_spec(ep.module)
        origin = spec.origin if spec is not None else None
        if origin is None or not origin.endswith(".py"):
            return True
        with open(origin, encoding="utf-8") as f:
            return hook_name in f.read()
    except (ImportError, OSError, ValueError, UnicodeDecodeError):
        return True  # loading it shows (and records) what is wrong


def plugins_for(hook_name: str) -> pluggy.PluginManager:
    """A plugin manager for one light question (the CLI's commands, the config's sections): the process-wide one
    when it exists (plugins registered in-process included), else one holding only the plugins that may implement
    ``hook_name`` (:func:`names_hook`), so that ``crosstrain --help`` does not import every backend, and torch with
    it. A plugin that fails to load is recorded as usual."""
    with _lock:
        if _manager is not None:
            return _manager
    pm = _new_manager()
    _load_entry_points(pm, only=lambda ep: names_hook(ep, hook_name))
    return pm


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


def _in_call_order(impls: list[HookImpl]) -> list[HookImpl]:
    first = [i for i in impls if i.tryfirst]
    last = [i for i in impls if i.trylast]
    return first + [i for i in impls if not (i.tryfirst or i.trylast)] + last


def _hook_impls(hook_name: str, pm: pluggy.PluginManager | None = None) -> list[HookImpl]:
    caller = getattr((pm or plugin_manager()).hook, hook_name, None)
    return [] if caller is None else list(caller.get_hookimpls())  # pluggy lists them registration order


def ordered_impls(hook_name: str, pm: pluggy.PluginManager | None = None) -> list[HookImpl]:
    """A hook's implementations in call order: ``tryfirst`` ones, then the rest in registration order (first
    registered first), then ``trylast`` ones. pluggy itself calls last-registered first; crosstrain
    documents and uses registration order, so model transforms apply in the order plugins were added.
    Wrappers are not in this list: :func:`call_each` and :func:`call_strict` run them around it."""
    return _in_call_order([i for i in _hook_impls(hook_name, pm) if not (i.hookwrapper or i.wrapper)])


def hook_wrappers(hook_name: str, pm: pluggy.PluginManager | None = None) -> list[HookImpl]:
    """A hook's wrappers (``wrapper=True`` or old-style ``hookwrapper=True``), outermost first."""
    return _in_call_order([i for i in _hook_impls(hook_name, pm) if i.hookwrapper or i.wrapper])


def _is_firstresult(hook_name: str, pm: pluggy.PluginManager) -> bool:
    caller = getattr(pm.hook, hook_name, None)
    return bool(caller is not None and caller.spec is not None and caller.spec.opts.get("firstresult"))


def _call(hook_name: str, kwargs: dict[str, Any], on_impl_error: Callable[[HookImpl, Exception], None],
          on_wrapper_error: Callable[[HookImpl, Exception], None],
          pm: pluggy.PluginManager | None = None) -> list[tuple[str, Any]]:
    """Every implementation in :func:`ordered_impls` order inside the hook's wrappers (the outermost first).

    A wrapper gets the list of results at its ``yield`` (an old-style one a ``pluggy.Result``) and may replace
    it with a list of the same length; an exception from an implementation is thrown into it. A
    ``firstresult`` hook stops at the first result that is not None.
    """
    from crosstrain.errors import PluginError

    pm = pm or plugin_manager()
    first_only = _is_firstresult(hook_name, pm)
    started: list[tuple[HookImpl, Generator[Any, Any, Any]]] = []
    error: BaseException | None = None
    for wrapper in hook_wrappers(hook_name, pm):
        try:
            gen = cast(Generator[Any, Any, Any], wrapper.function(**{k: kwargs[k] for k in wrapper.argnames}))
            next(gen)
        except Exception as exc:
            try:
                on_wrapper_error(wrapper, exc)
            except Exception as raised:
                error = raised
                break
            continue
        started.append((wrapper, gen))
    results: list[tuple[str, Any]] = []
    try:
        for impl in ordered_impls(hook_name, pm) if error is None else []:
            try:
                value = impl.function(**{k: kwargs[k] for k in impl.argnames})
            except Exception as exc:
                on_impl_error(impl, exc)
                continue
            results.append((impl.plugin_name, value))
            if first_only and value is not None:
                break
    except BaseException as exc:
        error = exc
    for wrapper, gen in reversed(started):
        problem: Exception | None = None
        values = [v for _, v in results]
        outcome = pluggy.Result(values if error is None else None, error)
        try:
            if wrapper.hookwrapper:
                gen.send(outcome)
            elif error is not None:
                gen.throw(error)
            else:
                gen.send(values)
            gen.close()
            problem = PluginError(f"plugin {wrapper.plugin_name!r}: its wrapper of {hook_name} yielded twice; "
                                  "yield once")
        except StopIteration as stop:
            if wrapper.hookwrapper:  # it may have forced another result or exception on the outcome
                error = outcome.exception
                replaced = values if error is not None else outcome.get_result()
            else:  # it returned (a result, also after swallowing the exception thrown into it)
                error, replaced = None, stop.value
            if error is None and not (isinstance(replaced, list) and len(replaced) == len(results)):
                problem = PluginError(f"plugin {wrapper.plugin_name!r}: its wrapper of {hook_name} returned "
                                      f"{replaced!r}; return the list of {len(results)} results it was given "
                                      "(changed or not)")
            elif error is None:
                results = [(name, value) for (name, _), value in zip(results, replaced, strict=True)]
        except Exception as exc:
            problem = None if exc is error else exc
        if problem is not None:
            try:
                on_wrapper_error(wrapper, problem)
            except Exception as raised:  # call_strict: the outer wrappers still see it, then the caller
                error = raised
    if error is not None:
        raise error
    return results


def call_each(hook_name: str, *, on_error: Callable[[str, BaseException], None] | None = None,
              manager: pluggy.PluginManager | None = None, **kwargs: Any) -> list[tuple[str, Any]]:
    """Call a hook on every plugin separately, so one raising plugin is reported and the rest still run.

    Returns ``(plugin_name, result)`` for every implementation that returned without raising, in
    :func:`ordered_impls` order, inside the hook's wrappers (see :func:`_call`); ``on_error(plugin_name, exc)``
    hears of each implementation or wrapper that raised (a raising wrapper leaves the results as they were).
    ``manager`` calls it on another plugin manager than the process-wide one (:func:`plugins_for`).
    """

    def report(impl: HookImpl, exc: Exception) -> None:
        record_error(impl.plugin_name, exc)
        if on_error is not None:
            on_error(impl.plugin_name, exc)

    return _call(hook_name, kwargs, report, report, manager)


def call_strict(hook_name: str, what: str, **kwargs: Any) -> list[tuple[str, Any]]:
    """Call a hook on every plugin in :func:`ordered_impls` order, inside its wrappers; a raising implementation
    or wrapper stops the run (PluginError).

    For run-time hooks whose silent failure would change what training does (model transforms, recipes,
    after-train exports). ``what`` completes the message "plugin X failed to ...".
    """
    from crosstrain.errors import CrosstrainError, PluginError

    def stop(impl: HookImpl, exc: Exception) -> None:
        if isinstance(exc, CrosstrainError):
            raise exc
        raise PluginError(f"plugin {impl.plugin_name!r} failed to {what}: {type(exc).__name__}: {exc}") from exc

    return _call(hook_name, kwargs, stop, stop)


def _invalidate() -> None:
    from crosstrain import registry

    registry.reset()
