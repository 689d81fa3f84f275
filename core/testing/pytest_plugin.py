"""pytest plugin (entry point ``pytest11``): the ``--backend`` option used by the conformance suite."""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("crosstrain")
    group.addoption("--backend", default=None,
                    help="crosstrain backend to test (default: $CROSSTRAIN_BACKEND or cpu)")


def selected_backend(config: pytest.Config) -> str:
    return str(config.getoption("--backend") or os.environ.get("CROSSTRAIN_BACKEND") or "cpu")
