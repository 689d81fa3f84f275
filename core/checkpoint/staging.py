"""Stage a flat ``{key: tensor}`` state to host memory for an async save.

Buffers are allocated once per key (page-locked through the active device's ``pin_memory`` when it
reports the ``pinned_memory`` capability) and reused by later saves, so staging is one copy per tensor.
DTensors keep their sharding spec around the staged local shard, so DCP plans the save exactly as for the
live state.
"""

from __future__ import annotations

from typing import Any

import torch


def _active_device() -> Any:
    try:
        from crosstrain.registry import active_backend

        backend = active_backend()
        return backend.device(), "pinned_memory" in backend.capabilities
    except Exception:  # no backend selected (library use): plain host memory
        return None, False


class HostStager:
    """Copies tensors into reusable host buffers."""

    def __init__(self, pin: bool | None = None) -> None:
        self._device, capable = _active_device()
        self.pin = capable if pin is None else pin
        self._buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu")
            if self.pin and self._device is not None and buf.numel() > 0:
                buf = self._device.pin_memory(buf)
            self._buffers[key] = buf
        return buf

    def stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Return host copies of ``tensors`` (DTensors stay DTensors around a host local shard)."""
        from torch.distributed.tensor import DTensor

        out: dict[str, torch.Tensor] = {}
        non_blocking = self.pin
        for key, tensor in tensors.items():
            tensor = tensor.detach()
            if isinstance(tensor, DTensor):
                local = tensor.to_local()
                buf = self._buffer(key, local)
                buf.copy_(local, non_blocking=non_blocking)
                # the constructor keeps the host buffer where it is (from_local would move it to the mesh device)
                out[key] = DTensor(buf, tensor._spec, requires_grad=False)
            else:
                buf = self._buffer(key, tensor)
                buf.copy_(tensor, non_blocking=non_blocking)
                out[key] = buf
        if non_blocking and self._device is not None:
            self._device.synchronize()
        return out

    def release(self) -> None:
        self._buffers.clear()
