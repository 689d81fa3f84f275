"""The CUDA device: ``torch.cuda`` through the common device-module API, NCCL, ``CUDA_VISIBLE_DEVICES``."""

from __future__ import annotations

from typing import Any

import torch

from crosstrain.backends.cuda.specs import NVIDIA_PARTS, PartSpec, resolve_peak_flops
from crosstrain.device import Availability, TorchModuleDevice


def cuda_build_problem() -> str | None:
    """Why this torch cannot drive NVIDIA GPUs at all, or None when it is a CUDA build."""
    hip = getattr(torch.version, "hip", None)
    if hip:
        return f"torch is a ROCm build (HIP {hip}); the 'rocm' backend drives this GPU"
    if not getattr(torch.version, "cuda", None):
        return f"torch {torch.__version__} was built without CUDA; install a CUDA build of torch"
    return None


class CudaDevice(TorchModuleDevice):
    """NVIDIA GPUs (``torch.cuda``); collectives over NCCL."""

    type = "cuda"
    dist_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    # NVIDIA's "Convolutional Layers User's Guide": tensor-core convolutions take NHWC; NCHW is transposed first
    prefers_channels_last = True
    #: parts table used by :meth:`peak_flops` and the kernel benchmark.
    parts: tuple[PartSpec, ...] = NVIDIA_PARTS
    label = "CUDA"
    driver_hint = "check the NVIDIA driver with nvidia-smi"

    def build_problem(self) -> str | None:
        return cuda_build_problem()

    def availability(self) -> Availability:
        problem = self.build_problem()
        if problem:
            return Availability(False, problem)
        if self.device_count() == 0:
            visible = self.visible_devices()
            where = f" ({self.visible_devices_env}={visible!r})" if visible is not None else ""
            return Availability(False, f"no {self.label} device visible{where}; {self.driver_hint}")
        return Availability(True)

    def device_count(self) -> int:
        if self.build_problem():
            return 0
        try:
            return int(torch.cuda.device_count())
        except Exception:  # a broken driver reports as no device, never as an exception
            return 0

    def device_name(self, index: int | None = None) -> str:
        return str(torch.cuda.get_device_name(torch.cuda.current_device() if index is None else index))

    def capability(self) -> tuple[int, int]:
        return tuple(torch.cuda.get_device_capability(torch.cuda.current_device()))  # type: ignore[return-value]

    def supports_bf16(self) -> bool:
        return bool(torch.cuda.is_bf16_supported())

    def supports_fp8(self) -> bool:
        """Hardware fp8 matmuls: Ada (sm_89), Hopper (sm_90) and newer."""
        return self.capability() >= (8, 9)

    def supported_dtypes(self) -> frozenset[torch.dtype]:
        dtypes = {torch.float32, torch.float16}
        if self.supports_bf16():
            dtypes.add(torch.bfloat16)
        return frozenset(dtypes)

    def autocast_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.supports_bf16() else torch.float16

    def part(self) -> PartSpec | None:
        from crosstrain.backends.cuda.specs import find_part

        return find_part(self.device_name(), self.parts)

    def peak_flops(self, dtype: torch.dtype) -> float:
        """Override, else the parts table by device name, else a one-off measured matmul rate."""
        return resolve_peak_flops(self.device_name(), dtype, self.parts, self.current_device)

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        if info["available"]:
            try:
                info["device_name"] = self.device_name(0)
                part = self.part()
                info["part"] = part.name if part else "unknown (peak FLOP/s measured)"
            except Exception as exc:  # describing never fails discovery
                info["device_name"] = f"unknown ({exc})"
        return info
