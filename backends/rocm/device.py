"""The ROCm device. torch's ROCm build exposes AMD GPUs as device type ``cuda`` (HIP behind ``torch.cuda``),
so this class reuses :class:`CudaDevice` and differs in detection, visibility variable and parts table.
Exactly one of cuda/rocm can be available in a process, because a torch build is either CUDA or ROCm.
"""

from __future__ import annotations

import os

import torch

from crosstrain.backends.cuda.device import CudaDevice
from crosstrain.backends.rocm.specs import AMD_PARTS, FP8_ARCHS


def rocm_build_problem() -> str | None:
    """Why this torch cannot drive AMD GPUs at all, or None when it is a ROCm build."""
    if getattr(torch.version, "hip", None):
        return None
    cuda = getattr(torch.version, "cuda", None)
    if cuda:
        return f"torch is a CUDA build (CUDA {cuda}), not ROCm; the 'cuda' backend drives this GPU"
    return f"torch {torch.__version__} was built without ROCm/HIP; install a ROCm build of torch"


class RocmDevice(CudaDevice):
    """AMD Instinct GPUs through HIP (``torch.cuda`` on a ROCm build); collectives over RCCL (``nccl``)."""

    type = "cuda"
    dist_backend = "nccl"
    visible_devices_env = "HIP_VISIBLE_DEVICES"
    # not CUDA's answer: PyTorch sends channels_last convolutions to MIOpen's NHWC path only under
    # PYTORCH_MIOPEN_SUGGEST_NHWC=1 (aten/src/ATen/native/ConvUtils.h, miopen_conv_use_channels_last: "remove once
    # ROCm officially supports NHWC in MIOpen"); otherwise the layout is converted back around every convolution
    prefers_channels_last = False
    parts = AMD_PARTS
    label = "ROCm"
    driver_hint = "check the amdgpu driver with rocm-smi"

    def build_problem(self) -> str | None:
        return rocm_build_problem()

    def visible_devices(self) -> str | None:
        """HIP_VISIBLE_DEVICES, else ROCR_VISIBLE_DEVICES or CUDA_VISIBLE_DEVICES (HIP honours all three)."""
        for var in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
            if var in os.environ:
                return os.environ[var]
        return None

    def arch(self) -> str:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return str(getattr(props, "gcnArchName", "")).split(":")[0]

    def supports_fp8(self) -> bool:
        return self.arch() in FP8_ARCHS
