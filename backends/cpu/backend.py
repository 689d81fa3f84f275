"""The CPU reference backend: the one CI runs, and the fallback every machine has."""

from __future__ import annotations

from crosstrain.backend import Backend
from crosstrain.backends.cpu.device import CpuDevice
from crosstrain.device import Device
from crosstrain.kernels import KernelRegistry


class CpuBackend(Backend):
    name = "cpu"
    priority = 0
    capabilities = frozenset({"bf16", "fp16"})
    install_hint = "cpu"

    def make_device(self) -> Device:
        return CpuDevice()

    def doctor_lines(self) -> list[tuple[str, str]]:
        from crosstrain.backends.cpu import native

        # Without the extension the fused optimizer steps fall back to the (slower) references.
        built = "built" if native.available() else "not built (optimizer steps use the references)"
        return [("native CPU optimizer", built)]

    def register_kernels(self, registry: KernelRegistry) -> None:
        # The references are the CPU kernels, except the native fused optimizer steps (when the extension is built).
        from crosstrain.backends.cpu.native import register

        register(registry, backend=self.name)
