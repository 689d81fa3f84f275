"""The XPU backend: torch's common device-module API does nearly all the work."""

from __future__ import annotations

import torch

from crosstrain.backend import Backend
from crosstrain.device import Availability, Device, TorchModuleDevice

# Peak dense bf16 FLOP/s per device, from Intel's published figures (override with CROSSTRAIN_PEAK_FLOPS).
PEAK_BF16 = {"Max 1550": 419e12, "Max 1100": 177e12}


class XpuDevice(TorchModuleDevice):
    type = "xpu"
    dist_backend = "xccl"
    visible_devices_env = "ZE_AFFINITY_MASK"

    def availability(self) -> Availability:
        xpu = getattr(torch, "xpu", None)
        if xpu is None:
            return Availability(False, "this torch has no torch.xpu module")
        if not xpu.is_available():
            return Availability(False, "torch.xpu reports no Intel GPU (driver missing or torch built without XPU)")
        return Availability(True)

    def peak_flops(self, dtype: torch.dtype) -> float:
        name = torch.xpu.get_device_name()
        for part, bf16 in PEAK_BF16.items():
            if part in name:
                return bf16 if dtype in (torch.bfloat16, torch.float16) else bf16 / 16
        return 0.0


class XpuBackend(Backend):
    name = "xpu"
    priority = 80
    capabilities = frozenset({"bf16", "fp16", "streams", "pinned_memory"})
    install_hint = ""

    def make_device(self) -> Device:
        return XpuDevice()
