"""Loads the simdev extension and registers it with torch, once per process: PrivateUse1 renamed ``simdev``,
``torch.simdev`` (:mod:`.module`), ``Tensor.simdev()`` / ``is_simdev``, and the c10d backend ``simgloo``."""

from __future__ import annotations

import threading
from types import ModuleType

import torch

DEVICE = "simdev"
#: the torch.distributed backend name of the staging collective backend
DIST_BACKEND = "simgloo"

_lock = threading.Lock()
_ext: ModuleType | None = None


def loaded() -> bool:
    """Whether this process has loaded (and registered) the extension."""
    return _ext is not None


def extension() -> ModuleType:
    """The loaded extension, registered with torch (building it first when the cache has none)."""
    global _ext
    with _lock:
        if _ext is None:
            from crosstrain.backends.simdev import build, module

            ext = build.load()
            ext.register_runtime()
            if torch._C._get_privateuse1_backend_name() != DEVICE:
                torch.utils.rename_privateuse1_backend(DEVICE)
            if getattr(torch, DEVICE, None) is None:
                torch._register_device_module(DEVICE, module)
                torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
            _register_collective(ext)
            _ext = ext
    return _ext


def _register_collective(ext: ModuleType) -> None:
    import torch.distributed as dist

    if not dist.is_available() or DIST_BACKEND.upper() in dist.Backend._plugins:
        return

    def create(store, rank: int, size: int, timeout):  # the c10d creator signature (store, rank, size, timeout)
        # gloo carries the bytes; its own key prefix, since a "cpu:gloo" backend of the same group shares `store`
        host = dist.ProcessGroupGloo(dist.PrefixStore("simgloo/", store), rank, size, timeout)
        return ext.StagingBackend(host, rank, size)

    dist.Backend.register_backend(DIST_BACKEND, create, devices=[DEVICE])
