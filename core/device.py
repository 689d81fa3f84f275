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
    #: bind the process group to this process's device (``init_process_group(device_id=...)``), so device meshes
    #: split the communicator (NCCL, HCCL); False where the collective backend cannot split (a gloo-staged one).
    bind_process_group: bool = True
    #: convolutions run faster on NHWC (``torch.channels_last``) tensors than on NCHW ones, so image recipes with
    #: ``vision.channels_last = "auto"`` convert their model and batches (PyTorch's "Channels Last Memory Format"
    #: tutorial; NVIDIA's cuDNN guide: tensor-core convolutions are NHWC, NCHW inputs pay a transpose). False
    #: unless the backend's vendor documents the gain.
    prefers_channels_last: bool = False

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

    def peak_flops_source(self, dtype: torch.dtype) -> str:
        """Where :meth:`peak_flops` got its figure (recorded in summary.json next to the MFU)."""
        if os.environ.get("CROSSTRAIN_PEAK_FLOPS"):
            return "$CROSSTRAIN_PEAK_FLOPS"
        return f"{type(self).__name__}.peak_flops (the backend's table or measurement)"

    def remeasure_peak_flops(self) -> None:
        """Forget measured peak figures, so the next :meth:`peak_flops` measures again (``doctor --measure``)."""

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
    """A Device that delegates to ``torch.<type>`` (the module every torch device type registers).

    Accelerator backends subclass this and set :attr:`type`, :attr:`dist_backend` and
    :attr:`visible_devices_env`, and override :meth:`peak_flops` (and :meth:`availability` where one call to the
    module's ``is_available()`` is not the whole story). Everything else follows torch's common device-module API;
    where a module lacks a function (``torch.cpu`` has no RNG or memory counters, and nothing to pin memory
    for), the host's equivalent is used, so the same class serves a device whose tensors live in host memory.
    """

    def _module(self) -> Any:
        return torch.get_device_module(self.type)

    def _get(self, name: str) -> Any:
        """The module's function ``name``, or None where this device type has none."""
        try:
            return getattr(self._module(), name, None)
        except (AttributeError, RuntimeError):  # torch has no module for this device type
            return None

    def availability(self) -> Availability:
        is_available = self._get("is_available")
        if is_available is None:
            return Availability(False, f"torch has no torch.{self.type} module; install the package that adds it")
        try:
            ok = bool(is_available())
        except Exception as exc:  # a probe never raises
            return Availability(False, f"torch.{self.type}.is_available() failed: {type(exc).__name__}: {exc}")
        return Availability(ok, "" if ok else f"torch.{self.type}.is_available() is False (no device visible)")

    def device_count(self) -> int:
        count = self._get("device_count")
        return int(count()) if count is not None else 1

    def set_device(self, device: torch.device | int) -> None:
        from crosstrain.autograd_exit import drain_at_exit

        fn = self._get("set_device")
        if fn is not None:
            fn(device)
        drain_at_exit(device if isinstance(device, torch.device) else torch.device(self.type, device))

    def current_device(self) -> torch.device:
        fn = self._get("current_device")
        current = fn() if fn is not None else 0
        if isinstance(current, torch.device):
            return current
        if isinstance(current, str):  # torch.cpu.current_device() returns "cpu"
            return torch.device(current)
        return torch.device(self.type, int(current))

    def synchronize(self) -> None:
        fn = self._get("synchronize")
        if fn is not None:
            fn()

    def stream(self) -> Any:
        cls = self._get("Stream")
        return cls() if cls is not None else None

    def event(self, enable_timing: bool = False) -> Any:
        cls = self._get("Event")
        if cls is None:
            return None
        try:
            return cls(enable_timing=enable_timing)
        except TypeError:  # torch.cpu.Event takes no arguments (and times nothing)
            return cls()

    def device_for_local_rank(self, local_rank: int) -> torch.device:
        # an out-of-tree device type (npu, a PrivateUse1 device) exists for torch.device() only once its module
        # is imported and registered
        self._module()
        return super().device_for_local_rank(local_rank)

    def _index(self) -> int:
        index = self.current_device().index
        return 0 if index is None else index

    def memory_stats(self) -> MemoryStats:
        allocated = self._get("memory_allocated")
        if allocated is None:  # tensors in host memory: this process's resident set
            from crosstrain.hostmem import current_rss, peak_rss, total_memory

            rss = current_rss()
            return MemoryStats(allocated=rss, reserved=rss, peak=max(peak_rss(), rss), total=total_memory())
        mod, index = self._module(), self._index()
        total = int(mod.get_device_properties(index).total_memory) if hasattr(mod, "get_device_properties") else 0
        return MemoryStats(
            allocated=int(allocated(index)),
            reserved=int(mod.memory_reserved(index)) if hasattr(mod, "memory_reserved") else int(allocated(index)),
            peak=int(mod.max_memory_allocated(index)),
            total=total,
        )

    def reset_peak_memory_stats(self) -> None:
        fn = self._get("reset_peak_memory_stats")
        if fn is not None:
            fn()
        else:
            from crosstrain.hostmem import reset_peak_rss

            reset_peak_rss()

    def empty_cache(self) -> None:
        fn = self._get("empty_cache")
        if fn is not None:
            fn()

    # a module without its own generator (torch.cpu) draws from torch's default (host) generator
    def get_rng_state(self) -> torch.Tensor:
        fn = self._get("get_rng_state")
        return fn() if fn is not None else torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        fn = self._get("set_rng_state")
        (fn or torch.set_rng_state)(state)

    def manual_seed(self, seed: int) -> None:
        fn = self._get("manual_seed")
        (fn or torch.manual_seed)(seed)

    def supported_dtypes(self) -> frozenset[torch.dtype]:
        return frozenset({torch.float32, torch.bfloat16, torch.float16})

    def autocast_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        # pinning is for copies to an accelerator; a host-memory device (or a host with none) has nothing to pin for
        accelerator = getattr(torch, "accelerator", None)
        if self.type == "cpu" or (accelerator is not None and not accelerator.is_available()):
            return tensor
        return tensor if tensor.is_pinned() else tensor.pin_memory()
