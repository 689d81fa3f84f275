"""The cuda Backend: CudaDevice, NCCL collectives and the shared Triton kernels on device type ``cuda``."""

from __future__ import annotations

from crosstrain.backend import Backend
from crosstrain.backends.triton import triton_installed
from crosstrain.device import Device
from crosstrain.diagnostics import env_lines, package_lines
from crosstrain.kernels import KernelRegistry

#: what every GPU this backend drives offers; hardware-dependent flags are adjusted by ``capabilities``.
GPU_CAPABILITIES = frozenset({"bf16", "fp16", "streams", "graph_capture", "triton", "pinned_memory"})


class GpuBackend(Backend):
    """Shared by cuda and rocm: capabilities follow the visible part and whether triton is installed."""

    priority = 100
    base_capabilities = GPU_CAPABILITIES
    #: ``torch.version`` attribute naming the GPU toolkit this torch was built with, for ``crosstrain doctor``.
    torch_build_attr = "cuda"
    #: environment variables ``crosstrain doctor`` shows when set.
    doctor_env: tuple[str, ...] = ("CUDA_VISIBLE_DEVICES", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_DEBUG",
                                   "TRITON_INTERPRET")

    @property  # type: ignore[override]
    def capabilities(self) -> frozenset[str]:
        caps = set(self.base_capabilities)
        if not triton_installed():
            caps.discard("triton")
        if "_device" not in self.__dict__:
            # Backend.__init__ validates the names: static flags only, so discovery never initialises the GPU.
            return frozenset(caps)
        hw = self.__dict__.get("_hw_caps")
        if hw is None:
            hw = self._probe_hardware()
        drop, add = hw
        return frozenset((caps - drop) | add)

    def _probe_hardware(self) -> tuple[set[str], set[str]]:
        """Flags the visible part removes or adds (cached once a device is available)."""
        drop: set[str] = set()
        add: set[str] = set()
        try:
            dev = self.device()
            if not dev.availability():
                return drop, add
            if not dev.supports_bf16():  # type: ignore[attr-defined]
                drop.add("bf16")
            if dev.supports_fp8():  # type: ignore[attr-defined]
                add.add("fp8")
        except Exception:  # a failing probe leaves the static set
            return drop, add
        self.__dict__["_hw_caps"] = (drop, add)
        return drop, add

    def doctor_lines(self) -> list[tuple[str, str]]:
        import torch

        build = getattr(torch.version, self.torch_build_attr, None)
        return [(f"torch.version.{self.torch_build_attr}", str(build) if build else "none (not a GPU build of torch)"),
                *package_lines("triton"), *env_lines(*self.doctor_env)]

    def register_kernels(self, registry: KernelRegistry) -> None:
        from crosstrain.backends.triton.register import register_triton_kernels

        register_triton_kernels(registry, backend=self.name, device_type="cuda")


class CudaBackend(GpuBackend):
    name = "cuda"
    install_hint = "cuda"
    k8s_resource = "nvidia.com/gpu"  # NVIDIA's k8s-device-plugin

    def make_device(self) -> Device:
        from crosstrain.backends.cuda.device import CudaDevice

        return CudaDevice()
