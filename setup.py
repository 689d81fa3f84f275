"""Build script: maps the top-level folders onto the ``crosstrain`` namespace.

``core/`` is imported as ``crosstrain``, ``backends/`` as ``crosstrain.backends`` and ``plugins/`` as
``crosstrain.plugins``; every folder with an ``__init__.py`` below them becomes a package. Native
extensions (the CPU backend's optimizer kernels) are declared in ``backends/cpu/native/build.py``.
"""

from __future__ import annotations

import importlib.util
import os

from setuptools import setup

ROOTS = {"crosstrain": "core", "crosstrain.backends": "backends", "crosstrain.plugins": "plugins"}


def _packages() -> tuple[list[str], dict[str, str]]:
    packages: list[str] = []
    package_dir: dict[str, str] = {}
    for name, folder in ROOTS.items():
        package_dir[name] = folder
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "_")) and d != "build"]
            if "__init__.py" not in filenames:
                continue
            rel = os.path.relpath(dirpath, folder)
            sub = "" if rel == "." else "." + rel.replace(os.sep, ".")
            packages.append(name + sub)
    return sorted(packages), package_dir


def _native() -> tuple[list, dict]:
    """The native extensions and the ``build_ext`` that takes them from the build cache when their sources,
    flags and compiler are unchanged (``backends/cpu/native/build.py``)."""
    path = os.path.join("backends", "cpu", "native", "build.py")
    if not os.path.exists(path):
        return [], {}
    spec = importlib.util.spec_from_file_location("_crosstrain_native_build", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module.ext_modules(), {"build_ext": module.cached_build_ext()}


packages, package_dir = _packages()
ext_modules, cmdclass = _native()
setup(packages=packages, package_dir=package_dir, ext_modules=ext_modules, cmdclass=cmdclass)
