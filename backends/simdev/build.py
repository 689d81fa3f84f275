"""Builds the simdev extension on first use (``torch.utils.cpp_extension.load``) into a cache kept across runs.

Built at run time, not at install time: the extension compiles against torch's C++ headers, which pip's isolated
build environment does not have (the CPU backend's install-time extensions use no torch headers for that reason).
The first import in a fresh cache compiles it (about a minute on two cores, ``benchmarks/simdev_build.py``); every
later process loads the cached library. The folder is keyed by a hash of the sources, and torch compiles the copy of
the sources kept in it: two checkouts of the same sources share one build, and different sources (another branch,
an edited runtime) get their own, instead of rebuilding one folder in turn (ninja rebuilds on any change of a
source's path) under processes that have it loaded.

Concurrent builds (two ranks starting at once) are serialised by :func:`build_lock`, an ``flock`` the kernel drops
when its holder dies. torch's own guard, a ``lock`` file its builder creates and deletes (``FileBaton``), stays
behind when a build is killed, and every later builder would wait for it forever; under our lock no live builder
holds it, so it is removed (a crosstrain from before this lock sharing the folder would not take it).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(HERE, "csrc")
SOURCES = ("memory.cpp", "device.cpp", "ops.cpp", "autocast.cpp", "collective.cpp", "module.cpp")
NAME = "crosstrain_simdev"


def source_files() -> list[str]:
    """The names of every source and header in csrc/ (what the build depends on)."""
    return sorted(f for f in os.listdir(CSRC) if f.endswith((".cpp", ".h")))


def source_key() -> str:
    """12 hex digits of the sha256 over csrc/'s file names and contents."""
    digest = hashlib.sha256()
    for name in source_files():
        with open(os.path.join(CSRC, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read() + b"\0")
    return digest.hexdigest()[:12]


def cache_dir() -> str:
    """``$CROSSTRAIN_SIMDEV_CACHE``, else ``$XDG_CACHE_HOME/crosstrain/simdev/torch-<version>``, then the
    sources' :func:`source_key`."""
    import torch

    explicit = os.environ.get("CROSSTRAIN_SIMDEV_CACHE", "").strip()
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    root = explicit or os.path.join(base, "crosstrain", "simdev", f"torch-{torch.__version__}")
    return os.path.join(root, source_key())


def _copy_sources(folder: str) -> str:
    """csrc/ copied into ``folder``/src (each file written whole, then renamed into place); returns that path."""
    src = os.path.join(folder, "src")
    os.makedirs(src, exist_ok=True)
    for name in source_files():
        target = os.path.join(src, name)
        with open(os.path.join(CSRC, name), "rb") as f:
            data = f.read()
        if os.path.exists(target):
            with open(target, "rb") as f:
                if f.read() == data:
                    continue
        tmp = f"{target}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    return src


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


@contextlib.contextmanager
def build_lock(folder: str) -> Iterator[None]:
    """Hold the exclusive ``flock`` of ``folder``/build.flock, and remove a ``lock`` file of torch's found there:
    every crosstrain builder of ``folder`` takes this lock before torch's, so that one was left by a dead builder."""
    os.makedirs(folder, exist_ok=True)
    fd = os.open(os.path.join(folder, "build.flock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released by the close below, or by the kernel when this process dies
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, "lock"))
        yield
    finally:
        os.close(fd)


def locked_load(build_directory: str, **kwargs: Any) -> Any:
    """``torch.utils.cpp_extension.load(build_directory=..., **kwargs)`` under :func:`build_lock`."""
    from torch.utils import cpp_extension

    find_ninja()
    with build_lock(build_directory):
        return cpp_extension.load(build_directory=build_directory, **kwargs)


def load(verbose: bool = False) -> ModuleType:
    """The compiled extension (built now when the cache has none for these sources)."""
    folder = cache_dir()
    src = _copy_sources(folder)
    module: ModuleType = locked_load(folder, name=NAME, sources=[os.path.join(src, s) for s in SOURCES],
                                     extra_cflags=["-O2"], verbose=verbose)
    return module
