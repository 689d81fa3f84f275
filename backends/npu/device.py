"""The NPU device: ``torch.npu`` (registered by ``torch_npu``), HCCL, ``ASCEND_RT_VISIBLE_DEVICES``.

``torch_npu`` is imported only when the device is probed or used, and only after ``importlib.util.find_spec``
says it is installed, so a machine without it lists the backend as unavailable with the reason.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch

from crosstrain.backends.cuda.specs import PartSpec, resolve_peak_flops
from crosstrain.device import Availability, TorchModuleDevice

T = 1e12
#: Ascend parts. ~313 TFLOPS fp16/bf16 is the commonly cited dense figure for the 910B (approximate; variants
#: B1..B4 differ): override with CROSSTRAIN_PEAK_FLOPS where a site knows its parts. No fp32 figure is listed,
#: so fp32 falls back to a measured matmul rate.
NPU_PARTS: tuple[PartSpec, ...] = (
    PartSpec("Ascend 910B", r"910B", {"bf16": 313 * T, "fp16": 313 * T}, 1.6e12),
)


def torch_npu_installed() -> bool:
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):
        return False


def import_torch_npu() -> Any:
    """Import ``torch_npu`` (which registers ``torch.npu``) and return it."""
    return importlib.import_module("torch_npu")


class NpuDevice(TorchModuleDevice):
    """Ascend NPUs through ``torch_npu``; collectives over HCCL."""

    type = "npu"
    dist_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    parts = NPU_PARTS

    def _module(self) -> Any:
        mod = getattr(torch, "npu", None)
        if mod is None:
            tnpu = import_torch_npu()
            mod = getattr(torch, "npu", None) or tnpu.npu
        return mod

    def availability(self) -> Availability:
        if not torch_npu_installed():
            return Availability(False, "torch_npu is not installed (it needs Ascend CANN)")
        try:
            import_torch_npu()
        except Exception as exc:  # CANN missing, version mismatch, ...
            return Availability(False, f"import torch_npu failed: {type(exc).__name__}: {exc}")
        count = self.device_count()
        if count == 0:
            visible = self.visible_devices()
            where = f" ({self.visible_devices_env}={visible!r})" if visible is not None else ""
            return Availability(False, f"no Ascend NPU visible{where}; check the driver with npu-smi")
        return Availability(True)

    def device_count(self) -> int:
        if not torch_npu_installed():
            return 0
        try:
            return int(self._module().device_count())
        except Exception:
            return 0

    def device_name(self) -> str:
        mod = self._module()
        return str(mod.get_device_name(mod.current_device()))

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        self._module()  # torch_npu must be imported for host pinning to target the NPU
        return tensor if tensor.is_pinned() else tensor.pin_memory()

    def peak_flops(self, dtype: torch.dtype) -> float:
        """Override, else the parts table by device name, else a one-off measured matmul rate."""
        return resolve_peak_flops(self.device_name(), dtype, self.parts, self.current_device,
                                  measure_unlisted_dtype=True)

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        if info["available"]:
            try:
                info["device_name"] = self.device_name()
            except Exception as exc:
                info["device_name"] = f"unknown ({exc})"
        return info
