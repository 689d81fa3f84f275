"""Small helpers for ``crosstrain doctor`` lines, shared by the core and by backends' ``doctor_lines()``."""

from __future__ import annotations

import importlib.metadata
import os


def package_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (a pip name, e.g. ``"torch"``), or None when it is absent."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_lines(*distributions: str) -> list[tuple[str, str]]:
    """One ``(name, version or "-")`` line per distribution, so a missing package shows as missing."""
    return [(name, package_version(name) or "-") for name in distributions]


def env_lines(*names: str) -> list[tuple[str, str]]:
    """One ``(NAME, value)`` line per environment variable that is set (unset ones are left out)."""
    return [(name, os.environ[name]) for name in names if name in os.environ]
