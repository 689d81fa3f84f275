"""Options and fixtures of the conformance suite."""

from __future__ import annotations

import pytest

from crosstrain import registry
from crosstrain.backend import Backend
from crosstrain.errors import CrosstrainError
from crosstrain.testing.pytest_plugin import selected_backend


def pytest_report_header(config: pytest.Config) -> str:
    return f"crosstrain conformance: backend={selected_backend(config)}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    name = selected_backend(config)
    try:
        backend = registry.get_backend(name)
    except CrosstrainError as exc:
        raise pytest.UsageError(str(exc)) from None
    avail = backend.availability()
    if not avail:
        reason = f"backend {name!r} unavailable here: {avail.reason}"
        config.issue_config_time_warning(pytest.PytestWarning(reason), stacklevel=2)
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def backend_name(pytestconfig: pytest.Config) -> str:
    return selected_backend(pytestconfig)


@pytest.fixture(scope="session")
def backend(backend_name: str) -> Backend:
    return registry.set_active_backend(backend_name)


@pytest.fixture(scope="session")
def device(backend: Backend):
    dev = backend.device()
    dev.set_device(dev.device_for_local_rank(0))
    return dev
