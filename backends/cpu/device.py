"""The CPU device: process memory from /proc, matmul peak measured and cached (:mod:`.peak`)."""

from __future__ import annotations

import os
import warnings

import torch

from crosstrain.backends.cpu import peak
from crosstrain.device import Availability, Device, MemoryStats
from crosstrain.hostmem import current_rss, peak_rss, reset_peak_rss, total_memory

#: a low-precision dtype whose matmuls reach under this share of fp32's speed gets a warning
SLOW_PRECISION_RATIO = 0.5


class SlowPrecisionWarning(UserWarning):
    """The chosen precision runs far slower than fp32 on this CPU."""


class CpuDevice(Device):
    """The host CPU as a training device (gloo collectives)."""

    type = "cpu"
    dist_backend = "gloo"
    visible_devices_env = None

    def __init__(self) -> None:
        self._peaks: dict[str, peak.Peak] = {}
        self._remeasure = False

    def availability(self) -> Availability:
        return Availability(True, "")

    def device_count(self) -> int:
        return 1

    def device_for_local_rank(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def set_device(self, device: torch.device | int) -> None:
        return None

    def current_device(self) -> torch.device:
        return torch.device("cpu")

    def synchronize(self) -> None:
        return None

    def memory_stats(self) -> MemoryStats:
        rss = current_rss()
        return MemoryStats(allocated=rss, reserved=rss, peak=max(peak_rss(), rss), total=total_memory())

    def reset_peak_memory_stats(self) -> None:
        reset_peak_rss()

    def get_rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def supported_dtypes(self) -> frozenset[torch.dtype]:
        return frozenset({torch.float32, torch.bfloat16, torch.float16})

    def autocast_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def peak_flops(self, dtype: torch.dtype) -> float:
        """Measured ``F.linear`` FLOP/s for ``dtype`` on the current thread count (see :mod:`.peak`)."""
        return self._peak(dtype).flops

    def peak_flops_source(self, dtype: torch.dtype) -> str:
        return self._peak(dtype).source

    def remeasure_peak_flops(self) -> None:
        self._peaks.clear()
        self._remeasure = True

    def _peak(self, dtype: torch.dtype) -> peak.Peak:
        if os.environ.get(peak.ENV_OVERRIDE):
            return peak.peak(dtype)  # read each time: it may be set after the first run of this process
        name = peak.key(dtype, torch.get_num_threads())
        if name not in self._peaks:
            self._peaks[name] = found = peak.peak(dtype, remeasure=self._remeasure)
            if dtype != torch.float32:
                self._warn_if_slow(dtype, found.flops)
        return self._peaks[name]

    def _warn_if_slow(self, dtype: torch.dtype, flops: float) -> None:
        fp32 = self._peak(torch.float32).flops
        if flops < SLOW_PRECISION_RATIO * fp32 and os.environ.get("RANK", "0") == "0":
            warnings.warn(f"{peak.dtype_name(dtype)} matrix multiplies run at {flops / 1e9:.1f} GFLOP/s on this CPU, "
                          f"{fp32 / max(flops, 1.0):.1f}x slower than fp32 ({fp32 / 1e9:.1f} GFLOP/s); "
                          "precision.dtype=fp32 trains faster here", SlowPrecisionWarning, stacklevel=2)
