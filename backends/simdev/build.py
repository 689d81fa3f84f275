"""Builds the simdev extension on first use (``torch.utils.cpp_extension.load``) into a cache kept across runs.

Built at run time, not at install time: the extension compiles against torch's C++ headers, which pip's isolated
build environment does not have (the CPU backend's install-time extensions use no torch headers for that reason).
The first import in a fresh cache compiles it (about a minute on two cores, ``benchmarks/simdev_build.py``); every
later process loads the cached library. torch rebuilds it when a source or flag changes and serialises concurrent
builds (two ranks starting at once) with a lock file in the build folder.
"""

from __future__ import annotations

import os
from types import ModuleType

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ("memory.cpp", "device.cpp", "ops.cpp", "autocast.cpp", "collective.cpp", "module.cpp")
NAME = "crosstrain_simdev"


def cache_dir() -> str:
    """``$CROSSTRAIN_SIMDEV_CACHE``, else ``$XDG_CACHE_HOME/crosstrain/simdev/torch-<version>``."""
    import torch

    explicit = os.environ.get("CROSSTRAIN_SIMDEV_CACHE", "").strip()
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "crosstrain", "simdev", f"torch-{torch.__version__}")


def find_ninja() -> str | None:
    """ninja's path; the pip package's binary next to this Python counts (put on PATH, where torch looks)."""
    import shutil
    import sys

    found = shutil.which("ninja")
    here = os.path.dirname(sys.executable)
    if found is None and os.path.isfile(os.path.join(here, "ninja")):
        os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")
        found = shutil.which("ninja")
    return found


def load(verbose: bool = False) -> ModuleType:
    """The compiled extension (built now when the cache has none for these sources)."""
    from torch.utils import cpp_extension

    find_ninja()

    folder = cache_dir()
    os.makedirs(folder, exist_ok=True)
    return cpp_extension.load(
        name=NAME,
        sources=[os.path.join(HERE, "csrc", s) for s in SOURCES],
        extra_cflags=["-O2"],
        build_directory=folder,
        verbose=verbose,
    )
