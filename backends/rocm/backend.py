"""The rocm Backend: RocmDevice, RCCL collectives and the same Triton kernels as cuda (AMD launch configs)."""

from __future__ import annotations

from crosstrain.backends.cuda.backend import GpuBackend
from crosstrain.device import Device


class RocmBackend(GpuBackend):
    name = "rocm"
    install_hint = "rocm"
    k8s_resource = "amd.com/gpu"  # AMD's k8s-device-plugin
    torch_build_attr = "hip"
    # HIP honours all three visibility variables (see RocmDevice.visible_devices).
    doctor_env = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES",
                  "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_DEBUG", "TRITON_INTERPRET")

    def make_device(self) -> Device:
        from crosstrain.backends.rocm.device import RocmDevice

        return RocmDevice()
