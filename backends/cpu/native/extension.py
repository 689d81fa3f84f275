"""Import the compiled native extensions (``_C``: optimizer steps, ``_kernels``: model ops), keeping why one is
missing for the message that names the fix."""

from __future__ import annotations

import importlib
from types import ModuleType

#: how to get a missing extension, for the messages of both
REBUILD = "install g++ and reinstall crosstrain (pip install -e . --no-deps)"


def import_extension(name: str) -> tuple[ModuleType | None, str]:
    """``crosstrain.backends.cpu.native.<name>`` and ``""``, or ``None`` and why it did not import."""
    try:
        return importlib.import_module(f"{__package__}.{name}"), ""
    except ImportError as exc:  # built without a compiler, or not rebuilt after a checkout
        return None, f"{type(exc).__name__}: {exc}"
