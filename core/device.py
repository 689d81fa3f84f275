"""The Device interface: one accelerator type, as the engine sees it.

A backend subclasses :class:`Device` (or :class:`TorchModuleDevice`, which delegates to the
``torch.<device_type>`` module that every torch accelerator exposes) and returns it from
``Backend.device()``. The core never names a concrete device API.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

#: Capability flags a backend may declare; the engine consults them instead of device names.
CAPABILITIES = ("bf16", "fp16", "fp8", "streams", "graph_capture", "triton", "pinned_memory")


@dataclass(frozen=True)
class Availability:
    """Whether a device can be used here, and the human-readable reason when it cannot."""

    available: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.available


@dataclass(frozen=True)
class MemoryStats:
    """Memory of one device in bytes. ``total`` is the device's capacity (0 when unknown)."""

    allocated: int
    reserved: int
    peak: int
    total: int

    def as_dict(self) -> dict[str, int]:
        return {"allocated": self.allocated, "reserved": self.reserved, "peak": self.peak, "total": self.total}


class Device(ABC):
    """One accelerator type (all of its local devices) for one process."""

    #: torch device type (``"cpu"``, ``"cuda"``, ``"npu"``, ...).
    type: str = "cpu"
    #: torch.distributed backend the device needs (gloo on the host; accelerators name their own library).
    dist_backend: str = "gloo"
    #: environment variable that restricts the visible devices, if any.
    visible_devices_env: str | None = None

    @abstractmethod
    def availability(self) -> Availability:
        """Probe at run time whether this device type can be used, with a reason when not."""

    def is_available(self) -> bool:
        return self.availability().available

    @abstractmethod
    def device_count(self) -> int:
        """Number of visible devices of this type on this host."""

    def device_for_local_rank(self, local_rank: int) -> torch.device:
        """The device a process with ``local_rank`` should use (round robin over visible devices)."""
        count = max(self.device_count(), 1)
        return torch.device(self.type, local_rank % count)

    def visible_devices(self) -> str | None:
        """The value of the visible-devices variable, or None when it is unset."""
        return os.environ.get(self.visible_devices_env) if self.visible_devices_env else None

    @abstractmethod
    def set_device(self, device: torch.device | int) -> None:
        """Make ``device`` the current device of this process."""

    @abstractmethod
    def current_device(self) -> torch.device:
        """The current device of this process."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for all queued work on the current device."""

    def stream(self) -> Any:
        """A new stream on the current device (``torch.Stream``), or None when streams are unsupported."""
        return None

    def event(self, enable_timing: bool = False) -> Any:
        """A new event on the current device (``torch.Event``), or None when unsupported."""
        return None

    @abstractmethod
    def memory_stats(self) -> MemoryStats:
        """Allocated, reserved, peak and total memory of the current device."""

    @abstractmethod
    def reset_peak_memory_stats(self) -> None:
        """Start a new peak-memory measurement."""

    def empty_cache(self) -> None:
        """Release cached, unused memory back to the device (no-op where there is no cache)."""

    @abstractmethod
    def get_rng_state(self) -> torch.Tensor:
        """The device's RNG state as a CPU uint8 tensor (checkpointed per rank)."""

    @abstractmethod
    def set_rng_state(self, state: torch.Tensor) -> None:
        """Restore a state returned by :meth:`get_rng_state`."""

    def manual_seed(self, seed: int) -> None:
        """Seed the device RNG (the CPU generator is seeded by the engine)."""

    @abstractmethod
    def supported_dtypes(self) -> frozenset[torch.dtype]:
        """Floating dtypes that train correctly on this device."""

    @abstractmethod
    def autocast_dtype(self) -> torch.dtype:
        """The preferred low-precision dtype for autocast on this device."""

    @abstractmethod
    def peak_flops(self, dtype: torch.dtype) -> float:
        """Peak dense FLOP/s of one device for ``dtype`` (used for MFU); 0.0 when unknown."""

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """Page-lock a host tensor when the device benefits from it; otherwise return it unchanged."""
        return tensor

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary for ``crosstrain backends`` and ``doctor``."""
        avail = self.availability()
        return {
            "type": self.type,
            "available": avail.available,
            "reason": avail.reason,
            "device_count": self.device_count() if avail.available else 0,
            "dist_backend": self.dist_backend,
            "visible_devices_env": self.visible_devices_env,
        }


class TorchModuleDevice(Device):
    """A Device that delegates to ``torch.<type>`` (the module every torch accelerator registers).

    Accelerator backends subclass this and override :meth:`availability`, :meth:`peak_flops` and the
    class attributes; everything else follows torch's common device-module API.
    """

    def _module(self) -> Any:
        return torch.get_device_module(self.type)

    def device_count(self) -> int:
        return int(self._module().device_count())

    def set_device(self, device: torch.device | int) -> None:
        self._module().set_device(device)

    def current_device(self) -> torch.device:
        return torch.device(self.type, self._module().current_device())

    def synchronize(self) -> None:
        self._module().synchronize()

    def stream(self) -> Any:
        return self._module().Stream()

    def event(self, enable_timing: bool = False) -> Any:
        return self._module().Event(enable_timing=enable_timing)

    def memory_stats(self) -> MemoryStats:
        mod = self._module()
        index = mod.current_device()
        total = int(mod.get_device_properties(index).total_memory)
        return MemoryStats(
            allocated=int(mod.memory_allocated(index)),
            reserved=int(mod.memory_reserved(index)),
            peak=int(mod.max_memory_allocated(index)),
            total=total,
        )

    def reset_peak_memory_stats(self) -> None:
        self._module().reset_peak_memory_stats()

    def empty_cache(self) -> None:
        self._module().empty_cache()

    def get_rng_state(self) -> torch.Tensor:
        return self._module().get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self._module().set_rng_state(state)

    def manual_seed(self, seed: int) -> None:
        self._module().manual_seed(seed)

    def supported_dtypes(self) -> frozenset[torch.dtype]:
        return frozenset({torch.float32, torch.bfloat16, torch.float16})

    def autocast_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.is_pinned() else tensor.pin_memory()
