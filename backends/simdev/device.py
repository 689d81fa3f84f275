"""The simdev device: ``torch.simdev`` through the shared :class:`~crosstrain.device.TorchModuleDevice` logic (the
same code path the npu backend takes), collectives staged through gloo (``cpu:gloo,simdev:simgloo``).

simdev is a software device for testing, not hardware. Probing it never builds or loads the extension (listing
backends stays fast); the first use of a tensor, a device call or a collective does.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from crosstrain.device import Availability, TorchModuleDevice

#: the variables simdev reads; the C++ runtime parses the same ones (backends/simdev/csrc)
DEVICES_ENV = "SIMDEV_DEVICES"
MEMORY_ENV = "SIMDEV_MEMORY_GB"
DEFAULT_DEVICES = 2


def configured_device_count() -> int:
    """``$SIMDEV_DEVICES`` (default 2), read without loading the extension."""
    raw = os.environ.get(DEVICES_ENV, "").strip()
    try:
        return int(raw) if raw else DEFAULT_DEVICES
    except ValueError:
        return 0


def build_problem() -> str | None:
    """Why the extension cannot be built here, or None."""
    from crosstrain.backends.simdev import runtime

    if runtime.loaded():
        return None
    from crosstrain.backends.simdev.build import find_ninja

    missing = [tool for tool, found in (("c++", shutil.which("c++")), ("ninja", find_ninja())) if found is None]
    if missing:
        return (f"simdev is compiled on first use and needs {' and '.join(missing)} on PATH "
                "(apt-get install g++ ninja-build, or pip install ninja)")
    return None


class SimdevDevice(TorchModuleDevice):
    """The simdev software device (PrivateUse1 renamed ``simdev``); see backends/simdev."""

    type = "simdev"
    dist_backend = "cpu:gloo,simdev:simgloo"
    visible_devices_env = None
    # gloo, which carries simgloo's bytes, cannot split a bound group's communicator for device meshes
    bind_process_group = False

    def _module(self) -> Any:
        from crosstrain.backends.simdev import runtime

        runtime.extension()
        return torch.simdev  # type: ignore[attr-defined]

    def availability(self) -> Availability:
        problem = build_problem()
        if problem:
            return Availability(False, problem)
        if not 1 <= configured_device_count() <= 64:
            return Availability(False, f"{DEVICES_ENV}={os.environ.get(DEVICES_ENV)!r} is not a device count "
                                       "from 1 to 64; set it like SIMDEV_DEVICES=2")
        return Availability(True)

    def device_count(self) -> int:
        from crosstrain.backends.simdev import runtime

        return int(self._module().device_count()) if runtime.loaded() else configured_device_count()

    def peak_flops(self, dtype: torch.dtype) -> float:
        """The host's measured figure: simdev computes with the CPU kernels (:mod:`crosstrain.backends.cpu.peak`)."""
        from crosstrain.backends.cpu import peak

        return peak.peak(dtype).flops

    def peak_flops_source(self, dtype: torch.dtype) -> str:
        from crosstrain.backends.cpu import peak

        return f"{peak.peak(dtype).source} (simdev runs the host's CPU kernels)"
