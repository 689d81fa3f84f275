"""Backend discovery and selection through pluggy: in-process plugins and real entry points."""

from __future__ import annotations

import pytest
import torch

from crosstrain import hookimpl, pluginmanager, registry
from crosstrain.backend import Backend
from crosstrain.device import Availability
from crosstrain.errors import BackendUnavailableError, PluginError
from crosstrain.testing.multiprocess import run_ranks  # noqa: F401  (imported to prove the module loads)


class FakeDevice:
    """Not a Device subclass on purpose: availability is all selection needs."""

    type = "cpu"
    dist_backend = "gloo"

    def __init__(self, available: bool, reason: str = "") -> None:
        self._avail = Availability(available, reason)

    def availability(self) -> Availability:
        return self._avail

    def describe(self) -> dict:
        return {"type": self.type, "available": self._avail.available, "reason": self._avail.reason,
                "device_count": 1, "dist_backend": self.dist_backend}


def make_backend(name: str, priority: int, available: bool, reason: str = "") -> Backend:
    cls = type(f"B_{name}", (Backend,), {"name": name, "priority": priority})
    b = cls()
    b.make_device = lambda: FakeDevice(available, reason)  # type: ignore[method-assign]
    return b


def test_cpu_is_discovered_and_available():
    backends = registry.backends()
    assert "cpu" in backends
    assert backends["cpu"].availability().available


def test_auto_picks_highest_priority_available_and_explains(backend_plugin):
    backend_plugin("fast", make_backend("fastbox", 500, False, "no fastbox card found"),
                   make_backend("okbox", 400, True))
    sel = registry.select_backend("auto")
    assert sel.backend.name == "okbox"
    text = sel.explain()
    assert "fastbox: skipped: no fastbox card found" in text
    assert "okbox: available" in text


def test_named_unavailable_backend_is_an_error_never_a_cpu_fallback(backend_plugin):
    backend_plugin("fast", make_backend("fastbox", 500, False, "no fastbox card found"))
    with pytest.raises(BackendUnavailableError, match="backend 'fastbox' is not available: no fastbox card found"):
        registry.select_backend("fastbox")


def test_env_var_selects_backend(backend_plugin, monkeypatch):
    backend_plugin("ok", make_backend("okbox", -5, True))
    monkeypatch.setenv("CROSSTRAIN_BACKEND", "okbox")
    assert registry.select_backend().backend.name == "okbox"
    monkeypatch.setenv("CROSSTRAIN_BACKEND", "nosuch")
    with pytest.raises(BackendUnavailableError, match="unknown backend 'nosuch'"):
        registry.select_backend()


def test_two_plugins_claiming_one_name_is_a_clear_error(backend_plugin):
    backend_plugin("a", make_backend("twin", 1, True))
    backend_plugin("b", make_backend("twin", 2, True))
    with pytest.raises(PluginError, match="backend name 'twin' is claimed by both plugin"):
        registry.backends()


def test_raising_plugin_is_reported_and_others_still_load(backend_plugin):
    class Broken:
        @hookimpl
        def crosstrain_register_backends(self):
            raise RuntimeError("driver exploded")

    backend_plugin("broken", Broken())
    backend_plugin("ok", make_backend("okbox", 1, True))
    assert "okbox" in registry.backends() and "cpu" in registry.backends()
    errors = [e for e in pluginmanager.load_errors() if e.name == "broken"]
    assert errors and "driver exploded" in errors[-1].error


def test_probe_that_raises_is_unavailable_not_fatal(backend_plugin):
    b = make_backend("flaky", 900, True)

    def boom():
        raise OSError("device node busy")

    b.make_device = boom  # type: ignore[method-assign]
    backend_plugin("flaky", b)
    avail = registry.backends()["flaky"].availability()
    assert not avail and "device node busy" in avail.reason
    assert registry.select_backend("auto").backend.name != "flaky"


def test_unknown_capability_is_rejected():
    cls = type("Bad", (Backend,), {"name": "bad", "capabilities": frozenset({"teleport"})})
    with pytest.raises(ValueError, match="unknown capabilities"):
        cls()


def test_set_active_backend_points_kernel_dispatch_at_it():
    b = registry.set_active_backend("cpu")
    from crosstrain.kernels import registry as kernels

    assert kernels.active_backend == b.name == "cpu"
    assert kernels.active_device_type == "cpu"
    assert registry.active_backend() is b
    assert b.device().current_device() == torch.device("cpu")
