"""Discovery and selection of backends.

``select_backend("auto")`` probes every discovered backend at run time and picks the available one with
the highest priority, logging why each other one was skipped. Asking for a named backend that is not
available is an error; crosstrain never silently falls back to the CPU.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from crosstrain import pluginmanager as plugins
from crosstrain.backend import Backend
from crosstrain.errors import BackendUnavailableError, PluginError

log = logging.getLogger("crosstrain.backends")

ENV_BACKEND = "CROSSTRAIN_BACKEND"

_backends: dict[str, Backend] | None = None
_active: Backend | None = None


def reset() -> None:
    """Forget discovered backends and the active one (after plugins change)."""
    global _backends, _active
    _backends = None
    _active = None
    from crosstrain.kernels import registry as kernel_registry

    kernel_registry.reset()


def backends() -> dict[str, Backend]:
    """All discovered backends by name. Two plugins claiming one name raise :class:`PluginError`."""
    global _backends
    if _backends is None:
        found: dict[str, Backend] = {}
        owners: dict[str, str] = {}
        for plugin_name, result in plugins.call_each("crosstrain_register_backends"):
            for backend in result or []:
                if not isinstance(backend, Backend):
                    plugins.record_error(plugin_name, f"returned {type(backend).__name__}, not a Backend")
                    continue
                if backend.name in found:
                    raise PluginError(
                        f"backend name {backend.name!r} is claimed by both plugin {owners[backend.name]!r} "
                        f"and plugin {plugin_name!r}; uninstall one of them"
                    )
                found[backend.name] = backend
                owners[backend.name] = plugin_name
        _backends = found
    return _backends


def get_backend(name: str) -> Backend:
    table = backends()
    if name not in table:
        known = ", ".join(sorted(table)) or "none"
        raise BackendUnavailableError(f"unknown backend {name!r}; discovered backends: {known}")
    return table[name]


@dataclass
class Selection:
    """The chosen backend and the probe log that explains the choice."""

    backend: Backend
    probes: list[tuple[str, bool, str]] = field(default_factory=list)

    def explain(self) -> str:
        lines = [f"selected backend {self.backend.name!r}"]
        for name, ok, reason in self.probes:
            lines.append(f"  {name}: {'available' if ok else 'skipped: ' + reason}")
        return "\n".join(lines)


def select_backend(requested: str | None = None) -> Selection:
    """Resolve ``requested`` (None reads ``CROSSTRAIN_BACKEND``, default ``auto``) to an available backend."""
    name = requested or os.environ.get(ENV_BACKEND) or "auto"
    table = backends()
    if name != "auto":
        backend = get_backend(name)
        avail = backend.availability()
        if not avail:
            hint = ""
            if backend.install_hint:
                hint = f" (install it with: pip install 'crosstrain[{backend.install_hint}]')"
            raise BackendUnavailableError(f"backend {name!r} is not available: {avail.reason}{hint}")
        return Selection(backend, [(name, True, "")])
    probes: list[tuple[str, bool, str]] = []
    candidates: list[Backend] = []
    for backend in sorted(table.values(), key=lambda b: (-b.priority, b.name)):
        avail = backend.availability()
        probes.append((backend.name, avail.available, avail.reason))
        if avail:
            candidates.append(backend)
    if not candidates:
        raise BackendUnavailableError("no backend is available: " + "; ".join(f"{n}: {r}" for n, _, r in probes))
    selection = Selection(candidates[0], probes)
    log.info(selection.explain())
    return selection


def active_backend() -> Backend:
    """The backend this process uses (selected on first call; one accelerator type per process)."""
    if _active is None:
        return set_active_backend(None)
    return _active


def set_active_backend(name_or_backend: str | Backend | None) -> Backend:
    """Choose the process's backend explicitly (``None`` or ``"auto"`` re-runs auto selection)."""
    global _active
    if isinstance(name_or_backend, Backend):
        _active = name_or_backend
    else:
        _active = select_backend(name_or_backend).backend
    from crosstrain.kernels import registry as kernel_registry

    kernel_registry.set_active_backend(_active.name, _active.device().type)
    return _active
