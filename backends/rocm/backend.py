"""The rocm Backend: RocmDevice, RCCL collectives and the same Triton kernels as cuda (AMD launch configs)."""

from __future__ import annotations

from crosstrain.backends.cuda.backend import GpuBackend
from crosstrain.device import Device


class RocmBackend(GpuBackend):
    name = "rocm"
    install_hint = "rocm"

    def make_device(self) -> Device:
        from crosstrain.backends.rocm.device import RocmDevice

        return RocmDevice()
