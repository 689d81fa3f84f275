"""The npu Backend: NpuDevice, HCCL collectives, torch_npu fused kernels on device type ``npu``."""

from __future__ import annotations

from crosstrain.backend import Backend
from crosstrain.device import Device
from crosstrain.diagnostics import env_lines, package_lines
from crosstrain.kernels import KernelRegistry


class NpuBackend(Backend):
    name = "npu"
    priority = 90
    capabilities = frozenset({"bf16", "fp16", "streams", "pinned_memory"})
    install_hint = "npu"
    k8s_resource = "huawei.com/Ascend910"  # Huawei's Ascend device plugin

    def make_device(self) -> Device:
        from crosstrain.backends.npu.device import NpuDevice

        return NpuDevice()

    def doctor_lines(self) -> list[tuple[str, str]]:
        # ASCEND_HOME_PATH is set by CANN's set_env.sh: unset usually means torch_npu will not import.
        return [*package_lines("torch-npu"),
                *env_lines("ASCEND_RT_VISIBLE_DEVICES", "ASCEND_HOME_PATH", "HCCL_CONNECT_TIMEOUT")]

    def register_kernels(self, registry: KernelRegistry) -> None:
        # Registration never imports torch_npu: the kernels import it on first call (on NPU tensors only).
        from crosstrain.backends.npu.kernels import register_npu_kernels

        register_npu_kernels(registry, backend=self.name)
